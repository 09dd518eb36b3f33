"""The compiled step kept on disk between processes (torch's `aot_compile`), on CPU.

Why: Inductor's cache under $TOOLKIT_CACHE/inductor saves the C++ build, but every start still
traces the whole model again with Dynamo before it can look that build up: on the default model
that trace was most of a warm start (docs/benchmarks.md). A saved step loads without tracing.

What: `CachedStep` stands where the torch.compile'd step would (transforms.compile_step). On the
first call with a new input signature it loads `$TOOLKIT_CACHE/compiled/<key>.aot`, or compiles the
step ahead of time on those inputs and saves it there. The file holds Dynamo's rewritten bytecode
and Inductor's compiled graph, not the weights: the model is handed in at load (`external_data`),
so any checkpoint of the same architecture, shapes and step options shares one file.

Calls skip Dynamo's guards (whose rebuild at load fails on the closure's model), so the key and the
signature stand in for what they check: the model's structure and constants, what the post-load
changes did (`applied`), every parameter's and buffer's dtype, sizes and strides (a RoPE table's length
is max_model_len's), the compile options, torch, Python, the CPU, the threads and the toolkit's
own sources (key); each input's dtype, rank, contiguity and every size the graph specialized on, i.e.
every size not marked unbacked (signature). That holds only where every size that changes between
steps is marked unbacked, so `applies` limits the cache to those steps: CPU, Inductor, no tensor
parallelism, an attention backend other than "torch" (runner.py). Where loading fails the step is
compiled again and the file replaced; where compiling or saving ahead of time fails, the step falls
back to torch.compile's JIT path with one warning. Off with `compile_cache=False`
(TOOLKIT_COMPILE_CACHE=0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import logging
import platform
import time
from pathlib import Path

import torch

from toolkit import envs

log = logging.getLogger("toolkit")

_SOURCE_PACKAGES = ("toolkit", "toolkit.attention", "toolkit.parallel")  # the model, its ops, the runner
_SOURCE_SUFFIXES = (".py", ".cpp", ".h")



def cache_dir() -> Path:
    return envs.cache_root() / "compiled"


def applies(config, attention_backend: str, tp) -> bool:
    """Where a saved step can stand in for Dynamo's guards (module docstring)."""
    return (config.compile_cache and not config.enforce_eager and config.compile_backend == "inductor"
            and torch.device(config.device).type == "cpu" and tp is None and attention_backend != "torch")


class CachedStep:
    """`fn(input_ids, positions, kv_caches, meta, logits_indices, hidden)`, a closure over `model`,
    compiled once per input signature: loaded from disk, or compiled ahead of time and saved."""

    def __init__(self, fn, model: torch.nn.Module, options: dict, applied: list[str], jit,
                 directory: Path | None = None):
        """`options`: torch.compile's; `applied`: what the post-load changes did (part of the key); `jit()`:
        the torch.compile'd step, for inputs that cannot be compiled ahead of time."""
        self.fn, self.model, self.options, self.jit = fn, model, options, jit
        self.directory = directory or cache_dir()
        self._model_key = _model_key(model, applied, options)
        self._graphs: dict[tuple, object] = {}
        self._kv_signature: tuple | None = None  # (the engine's KV cache list, its signature)
        self.sources: dict[str, str] = {}  # file name -> "loaded", "compiled" or "jit", for logs and tests

    def __call__(self, *args):
        signature = self._signature(args)
        graph = self._graphs.get(signature)
        if graph is None:
            graph = self._graphs[signature] = self._load_or_compile(signature, args)
        return graph(*args)

    def _signature(self, args) -> tuple:
        input_ids, positions, kv_caches, meta, logits_indices, hidden = args
        if self._kv_signature is None or self._kv_signature[0] is not kv_caches:
            # The engine's own list, passed on every call: its signature is worked out once.
            self._kv_signature = (kv_caches, tuple(_kv_cache_signature(c) for c in kv_caches))
        # meta.decode_only is read only by the torch attention backend, which `applies` leaves out.
        return (_tensor_signature(input_ids), _tensor_signature(positions), self._kv_signature[1], meta.backend,
                tuple(_tensor_signature(getattr(meta, f.name)) for f in dataclasses.fields(meta)
                      if isinstance(getattr(meta, f.name), torch.Tensor)),
                _tensor_signature(logits_indices), None if hidden is None else _tensor_signature(hidden))

    def path_for(self, signature: tuple) -> Path:
        digest = hashlib.sha256(json.dumps([self._model_key, repr(signature)]).encode()).hexdigest()[:32]
        return self.directory / f"step-{digest}.aot"

    def _load_or_compile(self, signature: tuple, args):
        path = self.path_for(signature)
        start = time.perf_counter()
        graph = self._load(path)
        if graph is not None:
            from torch._dynamo.utils import counters

            counters["toolkit"]["loaded_steps"] += 1  # beside Dynamo's graph count (runner.num_compiled_graphs)
            self.sources[path.name] = "loaded"
            log.info("loaded the compiled step from %s in %.1f s", path, time.perf_counter() - start)
            return graph
        try:
            graph = aot_compile(self.fn, self.options, args)
        except Exception as e:  # experimental in torch 2.13: the JIT path serves instead
            log.warning("compiling the step ahead of time failed (%s: %s); using torch.compile's JIT path",
                        type(e).__name__, e)
            self.sources[path.name] = "jit"
            return self.jit()
        graph.disable_guard_check()  # the key and the signature stand in for them (module docstring)
        self.sources[path.name] = "compiled"
        self._save(graph, path)
        return graph

    def _load(self, path: Path):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:  # unreadable, or the folder is not one: compile, and say why it is not kept
            log.warning("could not read the compiled step %s (%s); compiling it", path, e)
            return None
        try:
            return load(data, self.model, self.options)
        except Exception as e:  # a file from another build, or damaged: compile anew and replace it
            log.warning("could not load the compiled step %s (%s: %s); compiling it again", path, type(e).__name__, e)
            return None

    def _save(self, graph, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # torch writes it aside and renames it: a reader never sees half a file.
            graph.save_compiled_function(str(path), external_data={"model": self.model})
        except Exception as e:  # the graph still serves this process; the next start compiles again
            log.warning("could not save the compiled step to %s (%s: %s)", path, type(e).__name__, e)


def aot_compile(fn, options: dict, args: tuple):
    """`fn` compiled ahead of time on `args` as the JIT step is (transforms.compile_function)."""
    return torch.compile(fn, fullgraph=True, dynamic=True, options=options).aot_compile((args, {}))


class _NoGuards:
    """Stands for the guard manager a load would rebuild: CachedStep checks the signature instead."""

    def check(self, f_locals) -> bool:
        return True


def load(data: bytes, model: torch.nn.Module, options: dict | None = None):
    """A step saved by CachedStep, its closure's model replaced by `model`: torch's
    `AOTCompiledFunction.deserialize`, less the guard manager's rebuild, which fails on the closure
    variable and which the signature replaces. `options`, the compile options the step was compiled
    with, hold again while it loads: loading its C++ reads Inductor's config, and the library's key
    is made from it (the CPU backend's `cpp.vec_isa_ok` also spares the load the base ISA checks)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction, AOTCompileUnpickler, CompileArtifacts
    from torch._dynamo.package import SerializedCode

    state = AOTCompileUnpickler({"model": model}, io.BytesIO(data)).load()
    state["runtime_env"] = dataclasses.replace(
        state["runtime_env"], bytecode=SerializedCode.to_code_object(state["runtime_env"].bytecode))
    deserializer, compiled_state = state["compiled_fn"]
    known = torch._inductor.config.get_config_copy()
    inductor = {k: v for k, v in (options or {}).items() if k in known}
    with torch._inductor.config.patch({**inductor, "enable_autograd_for_aot": True}), _no_header_precompiling():
        state["compiled_fn"] = deserializer(compiled_state)
    state["original_code"] = SerializedCode.to_code_object(state["original_code"])
    state["guard_manager"] = _NoGuards()
    graph = AOTCompiledFunction(CompileArtifacts(**state))
    graph.disable_guard_check()
    return graph


@contextlib.contextmanager
def _no_header_precompiling():
    """Inductor precompiles its C++ header (preprocessing all of it, then hashing that) before it
    looks for the library it would build, so every load paid that for a library already built. The
    compile options stay as they were (they are in the library's key); only that work is skipped.
    Where the library is gone it builds without the precompiled header: slower, the same code."""
    from torch._inductor import codecache

    precompile = getattr(codecache, "_precompile_header", None)
    if precompile is None:  # another torch: loading still works, as before
        yield
        return
    codecache._precompile_header = lambda *args, **kwargs: None
    try:
        yield
    finally:
        codecache._precompile_header = precompile


def _tensor_signature(t: torch.Tensor) -> tuple:
    unbacked = getattr(t, "_dynamo_unbacked_indices", ())
    return (t.dtype, t.device.type, tuple(None if i in unbacked else n for i, n in enumerate(t.shape)),
            t.is_contiguous())


def _kv_cache_signature(cache: torch.Tensor) -> tuple:
    # The block count (dim 1) is dynamic (runner.py), with one guard: at least 2.
    sizes = list(cache.shape)
    sizes[1] = ">=2" if sizes[1] >= 2 else sizes[1]
    return (cache.dtype, cache.device.type, tuple(sizes), cache.is_contiguous())


def _model_key(model: torch.nn.Module, applied: list[str], options: dict) -> dict:
    from toolkit.backends.cpu.build import cpu_flags

    return {
        "model": repr(model),  # module types (merged, packed, quantized linears), shapes, norms
        "constants": [sorted((n, v) for n, v in vars(m).items() if isinstance(v, (int, float, bool, str)))
                      for m in model.modules()],
        # Every tensor's layout: the graph specializes on them (a RoPE table's length is max_model_len's)
        # and the saved graph asserts them, so a step saved for other sizes must not be found.
        "tensors": _tensor_layouts(model),
        "applied": applied,  # what the post-load changes did: the linear plan, int8, merges
        "options": {k: repr(v) for k, v in options.items() if not callable(v)},  # not the guard filter
        "torch": torch.__version__,
        "python": platform.python_version(),  # the file carries Dynamo's rewritten bytecode
        "threads": torch.get_num_threads(),  # Inductor writes the thread count into its C++ loops
        "cpu": cpu_flags(),  # Inductor's C++ is built for this CPU, as the kernels are
        "sources": _sources_digest(),
    }


def _tensor_layouts(model: torch.nn.Module) -> list:
    """(name, dtype, sizes, strides) of every parameter, buffer and tensor attribute of every module."""
    out = []
    for prefix, module in model.named_modules():
        tensors = {**module._parameters, **module._buffers,
                   **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
        out += [(f"{prefix}.{name}", str(t.dtype), tuple(t.shape), t.stride() if t.layout == torch.strided else None)
                for name, t in sorted(tensors.items()) if t is not None]
    return out


@functools.cache
def _sources_digest() -> str:
    import importlib

    h = hashlib.sha256()
    for name in _SOURCE_PACKAGES:
        # A checkout's attention/, or a wheel's toolkit/attention/ (toolkit.__path__ also holds a checkout's root).
        folder = Path(importlib.import_module(name).__file__).parent
        for path in sorted(folder.rglob("*")):
            if path.suffix in _SOURCE_SUFFIXES and path.is_file():
                h.update(f"{name}/{path.relative_to(folder)}".encode())
                h.update(path.read_bytes())
    return h.hexdigest()
