"""Triton kernels under test on CPU run in the interpreter (TRITON_INTERPRET=1); import this module
before torch or triton in a module that tests them.

TRITON_INTERPRET must be set before triton is first imported: triton's own @jit helpers (tl.zeros,
tl.max, ...) are built at import, and a non-interpreted one called from an interpreted kernel raises.
Another test module (anything importing torch._inductor) may have imported triton already in this
pytest process; then NEEDS_FRESH_PROCESS is true and the module reruns itself in a new interpreter.
Set TOOLKIT_TEST_DEVICE=cuda to run the same checks with compiled kernels on a GPU.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

DEVICE = os.environ.get("TOOLKIT_TEST_DEVICE", "cpu")


def _interpreter_still_possible() -> bool:
    if "triton" not in sys.modules:
        return True
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


NEEDS_FRESH_PROCESS = DEVICE == "cpu" and not _interpreter_still_possible()
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

FRESH_TEST = "test_module_in_fresh_process"


def skip_unless_here(request) -> None:
    """In a process where the interpreter came too late, every test but FRESH_TEST is skipped (FRESH_TEST runs them)."""
    import pytest

    if NEEDS_FRESH_PROCESS and request.node.originalname != FRESH_TEST:
        pytest.skip(f"triton was imported without TRITON_INTERPRET; {FRESH_TEST} runs these")


def run_module_in_fresh_process(test_file: str, min_passed: int, timeout: int) -> None:
    """The whole module `test_file`, in a new interpreter where TRITON_INTERPRET is set before triton
    loads; at least `min_passed` of its tests must pass there (the kernels really ran)."""
    import pytest

    if os.environ.get("_TOOLKIT_TRITON_CHILD"):
        pytest.fail("triton was imported before TRITON_INTERPRET even in a fresh process")
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file).resolve())]
    env = dict(os.environ, TRITON_INTERPRET="1", _TOOLKIT_TRITON_CHILD="1")
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) >= min_passed, result.stdout[-3000:]
