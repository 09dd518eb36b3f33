"""Every environment variable the toolkit reads, in one place (vLLM's `envs.py` habit).

A variable only ever sets a default: the engine's behaviour is decided by `EngineConfig`'s fields
(toolkit/config.py), and a field given in code or on the command line wins over the variable.
Read lazily, on each call, so a test or a notebook can change one before building an engine.

| variable | default | what it sets |
|---|---|---|
| `TOOLKIT_CACHE` | `~/.cache/toolkit` | the root of everything built: kernels, Inductor's caches, kernel choices, the default model, GGUF files' indexes and tokenizers, compiled steps |
| `TOOLKIT_CPU_KERNELS` | `1` | `EngineConfig.cpu_kernels`: build and use the C++ CPU kernels (0: torch's own ops) |
| `TOOLKIT_CPU_LINEAR` | `auto` | `EngineConfig.cpu_linear`: which linear implementation serves which row counts |
| `TOOLKIT_CPU_PREFILL_ATTENTION` | `auto` | `EngineConfig.cpu_prefill_attention`: which prefill chunks go to ATen's flash attention |
| `TOOLKIT_CPP_WRAPPER` | `1` | `EngineConfig.cpp_wrapper`: compiled CPU steps run Inductor's C++ wrapper |
| `TOOLKIT_COMPILE_CACHE` | `1` | `EngineConfig.compile_cache`: compiled CPU steps are saved under `$TOOLKIT_CACHE/compiled` and loaded at the next start |
| `CXX` | `c++` | the C++ compiler for the CPU kernels |
| `ONEDNN_PRIMITIVE_CACHE_CAPACITY` | set to `4096` on import if unset | oneDNN's own: how many compiled matmul primitives it keeps (see `set_process_defaults`) |

`parallel/` reads its own `TOOLKIT_DIST_TIMEOUT` (parallel/distributed.py): a leaf package does not
import the toolkit.
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_LINEAR_CHOICES = ("auto", "panel", "onednn", "torch")
CPU_PREFILL_ATTENTION_CHOICES = ("auto", "flash", "tiles")


def cache_root() -> Path:
    """The folder under which the toolkit keeps what it builds."""
    return Path(os.environ.get("TOOLKIT_CACHE") or Path.home() / ".cache" / "toolkit")


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {raw!r}")


def cpu_kernels() -> bool:
    return _flag("TOOLKIT_CPU_KERNELS", True)


def cpu_linear() -> str:
    value = os.environ.get("TOOLKIT_CPU_LINEAR") or "auto"
    if value not in CPU_LINEAR_CHOICES:
        raise ValueError(f"TOOLKIT_CPU_LINEAR must be one of {', '.join(CPU_LINEAR_CHOICES)}, got {value!r}")
    return value


def cpu_prefill_attention() -> str:
    value = os.environ.get("TOOLKIT_CPU_PREFILL_ATTENTION") or "auto"
    if value not in CPU_PREFILL_ATTENTION_CHOICES:
        raise ValueError(f"TOOLKIT_CPU_PREFILL_ATTENTION must be one of {', '.join(CPU_PREFILL_ATTENTION_CHOICES)}, "
                         f"got {value!r}")
    return value


def cpp_wrapper() -> bool:
    return _flag("TOOLKIT_CPP_WRAPPER", True)


def compile_cache() -> bool:
    return _flag("TOOLKIT_COMPILE_CACHE", True)


def cxx() -> str:
    return os.environ.get("CXX") or "c++"


def set_process_defaults() -> None:
    """Defaults for libraries the toolkit uses, set when it is imported (a value already set wins).

    oneDNN compiles one primitive per matmul shape, and a step's row count changes every step. The
    CPU kernels round it up to one of at most 128 per weight shape up to 2,048 rows (`onednn_rows`,
    csrc/panel_kernel.h), but a model's shapes times those, plus any other oneDNN user in the process
    (another model, the benchmark's transformers peer), can pass oneDNN's default 1024 primitives:
    each evicted one is compiled again at its next use (measured: docs/benchmarks.md). oneDNN reads
    the variable when torch loads, so this runs when `toolkit` is imported, before it imports torch:
    a program that imports torch first sets the variable itself (the `toolkit` command imports the
    toolkit first).
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "4096")
