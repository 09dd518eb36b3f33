"""Builds the project's plain C++ CPU kernels and caches the shared libraries.

Three kernels use it: decode attention (`attention/paged_decode_cpu.cpp`), the panel linear
(`toolkit/linear_cpu.cpp`) and the decode step over both (`toolkit/decode_step_cpu.cpp`). They
have no torch headers, so each compiles in 2-3 s with the C++ compiler that torch.compile already
needs (`$CXX`, else `c++`); a CPU engine builds them at once when it starts (`build_all`), and
`load` finds them built. A library is cached under `$TOOLKIT_CACHE/kernels` (default
`~/.cache/toolkit/kernels`), keyed by the source and the local headers it includes
(`toolkit/half_float.h`), the flags, the compiler and this CPU's feature flags (it is built with
-march=native). Loaded after torch, its
OpenMP calls use torch's OpenMP runtime and thread count.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# Linked in a second step without -ffast-math: gcc links crtfastmath.o into a -ffast-math shared
# library, and loading it would switch the whole process to flush-to-zero floats.
LINK_FLAGS = ("-shared", "-fopenmp")


def cache_dir() -> Path:
    # toolkit.paths.cache_root(), read here directly: importing the toolkit package from attention/
    # would import the whole engine.
    return Path(os.environ.get("TOOLKIT_CACHE") or Path.home() / ".cache" / "toolkit") / "kernels"


def cpu_flags() -> str:
    """This CPU's feature flags: code built with -march=native is valid only where they match."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _texts(source: Path) -> list[str]:
    """The source and the local headers it includes (`#include "name.h"`, beside it; one level)."""
    text = source.read_text()
    return [text, *((source.parent / name).read_text() for name in re.findall(r'^#include "([^"]+)"', text, re.M))]


def build(source: Path, compiler: str | None = None) -> Path:
    """Compile `source` (or find it already compiled) and return the shared library's path."""
    compiler = compiler or os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler {compiler!r} on PATH (set CXX)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = "\0".join([*_texts(source), *FLAGS, *LINK_FLAGS, version, cpu_flags()])
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes (torchrun ranks) never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = os.path.join(tmp, "kernel.o"), os.path.join(tmp, "kernel.so")
        for command in ([compiler, *FLAGS, "-c", str(source), "-o", obj], [compiler, *LINK_FLAGS, obj, "-o", lib]):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"building {source.name} failed ({' '.join(command)}):\n{done.stderr.strip()}")
        os.replace(lib, target)
    return target


def build_all(kernels: dict[Path, str]) -> None:
    """Build every kernel (source -> its on/off switch) not switched off, at once: one compiler process
    each, so a cold start waits for the slowest build instead of their sum (4.4 -> 3.0 s here).
    Failures are left for `load` to report, with its fallback."""
    sources = [source for source, switch in kernels.items() if os.environ.get(switch, "1") != "0"]
    if sources:
        with ThreadPoolExecutor(len(sources)) as pool:
            for future in [pool.submit(build, source) for source in sources]:
                future.exception()


def load(source: Path, switch: str, what: str, fallback: str, signatures: dict) -> ctypes.CDLL | None:
    """The kernel's library, built if need be, its functions typed from `signatures` (name ->
    (argtypes, restype)); None where `$switch` is 0 or it cannot be built (then one warning says
    that `fallback` is used instead)."""
    if os.environ.get(switch, "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build(source)))
    except (OSError, RuntimeError) as err:
        warnings.warn(f"{what} unavailable, using {fallback}: {err}", RuntimeWarning)
        return None
    for name, (argtypes, restype) in signatures.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, restype
    return lib
