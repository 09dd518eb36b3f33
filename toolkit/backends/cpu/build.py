"""Builds the CPU kernels (`csrc/*.cpp`) into shared libraries of torch ops, and caches them.

Each kernel registers its ops through torch's stable C ABI (`torch/csrc/stable`), which needs no C++
torch API: a kernel compiles in a few seconds with the compiler torch.compile already needs (`$CXX`,
else `c++`), and a compiled graph calls its ops through the dispatcher, from C++. The engine builds
the ones its model needs at once when it starts (kernels.start_build), one compiler process each.

A library is cached under `$TOOLKIT_CACHE/kernels`, keyed by the source and the local headers it
includes, the flags, the compiler, torch's version and this CPU's feature flags (it is built with
-march=native). Loaded after torch, its OpenMP calls use torch's OpenMP runtime and thread count.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from toolkit import envs

CSRC = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
# Linked in a second step without -ffast-math: gcc links crtfastmath.o into a -ffast-math shared
# library, and loading it would switch the whole process to flush-to-zero floats.
LINK_FLAGS = ("-shared", "-fopenmp")


class BuildError(RuntimeError):
    """A kernel could not be built; the message names the source and says why."""


def cache_dir() -> Path:
    return envs.cache_root() / "kernels"


def cpu_flags() -> str:
    """This CPU's feature flags: code built with -march=native is valid only where they match."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _torch_dirs() -> tuple[Path, Path]:
    root = Path(torch.__file__).resolve().parent
    return root / "include", root / "lib"


def _texts(source: Path, seen: set[Path] | None = None) -> list[str]:
    """The source and every local header it includes (`#include "name.h"`, beside it), recursively."""
    seen = set() if seen is None else seen
    seen.add(source)
    text = source.read_text()
    texts = [text]
    for name in re.findall(r'^#include "([^"]+)"', text, re.M):
        header = source.parent / name
        if header not in seen:
            if not header.is_file():
                raise BuildError(f"{source} includes {name}, which is missing beside it ({header})")
            texts += _texts(header, seen)
    return texts


def library_path(source: Path, compiler: str | None = None) -> Path:
    """Where the library built from `source` lives (built or not)."""
    compiler = compiler or envs.cxx()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = "\0".join([*_texts(source), *FLAGS, *LINK_FLAGS, version, cpu_flags(), torch.__version__])
    return cache_dir() / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build(source: Path, compiler: str | None = None) -> Path:
    """Compile `source` (or find it already compiled) and return the shared library's path."""
    compiler = compiler or envs.cxx()
    if shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler {compiler!r} on PATH to build {source} (set CXX)")
    if not source.is_file():
        raise BuildError(f"kernel source {source} is missing: the installed package is incomplete")
    target = library_path(source, compiler)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    include, lib = _torch_dirs()
    # Built beside the target and renamed: concurrent processes (torchrun ranks) never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, out = Path(tmp, "kernel.o"), Path(tmp, "kernel.so")
        commands = (
            [compiler, *FLAGS, f"-I{include}", "-c", str(source), "-o", str(obj)],
            [compiler, *LINK_FLAGS, str(obj), "-o", str(out), f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"],
        )
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise BuildError(f"building {source} failed ({' '.join(command)}):\n{done.stderr.strip()[-4000:]}")
        out.replace(target)
    return target


def build_or_error(source: Path) -> Path | BuildError:
    """`build(source)`, or the error that stopped it."""
    try:
        return build(source)
    except (BuildError, OSError) as err:
        return err if isinstance(err, BuildError) else BuildError(f"building {source} failed: {err}")


def build_all(sources: list[Path]) -> dict[Path, Path | BuildError]:
    """Build every source at once, one compiler process each, so a cold start waits for the slowest
    build instead of their sum. Returns each source's library or the error that stopped it."""
    with ThreadPoolExecutor(max(1, len(sources))) as pool:
        futures = {source: pool.submit(build_or_error, source) for source in sources}
        return {source: future.result() for source, future in futures.items()}
