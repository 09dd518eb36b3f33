"""Decoder-layer graphs compiled ahead of time and kept on disk (torch's `aot_compile`), on CPU.

Why: the JIT path (`layer.compile`) pays twice per start and per call.
- Start: a warm Inductor cache still re-traces each graph with Dynamo, ~6-7 s per graph for the
  125M benchmark model here. A saved graph loads in ~2 s.
- Call: each of the 12 layer calls of a step goes through Dynamo's frame hook and guard tree,
  ~100-250 us a layer here: at batch 1 that is most of what is not matmul.

How: one graph per step kind, decode-only or not, as Dynamo would make (the two graphs the JIT
path compiles; sizes are dynamic, see runner.py). The graph of a kind is loaded from
$TOOLKIT_CACHE/precompiled/<key>.aot, or traced and compiled on the first step of that kind and
saved there. Calls skip Dynamo's guards: this class picks the graph by step kind itself, and the
key holds everything the guards would check that can change between runs (the layer's structure and
constants, dtype, KV cache shape, attention backend, kernel availability, torch version, CPU, the
toolkit's own sources). The runner's prepare() upholds the rest: token counts padded to at least
MIN_BUCKET and the same dynamic-size markings on every step that reaches the graphs (decode steps
for the C++ decode step, toolkit/decode_step_cpu.py, are neither).

`aot_compile` is experimental in torch 2.13. Where it fails, or `TOOLKIT_PRECOMPILE=0`, layers fall
back to the JIT path with one warning; a file that does not load is compiled again and replaced.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import platform
import time
import weakref
from pathlib import Path

import torch

from toolkit.paths import cache_root

log = logging.getLogger("toolkit")

SWITCH = "TOOLKIT_PRECOMPILE"
_SOURCE_ROOTS = ("toolkit", "attention")  # the model, its linears, the runner and the attention ops
KINDS = {False: "mixed", True: "decode"}


def enabled(device: torch.device, compile_backend: str, tp) -> bool:
    """CPU, Inductor, one process: where this was built and measured. Off with TOOLKIT_PRECOMPILE=0."""
    return (os.environ.get(SWITCH, "1") != "0" and torch.device(device).type == "cpu"
            and compile_backend == "inductor" and tp is None)


@functools.cache
def _sources_digest() -> str:
    repo = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for root in _SOURCE_ROOTS:
        for path in sorted((repo / root).rglob("*")):
            if path.suffix in (".py", ".cpp", ".h") and path.is_file():
                h.update(str(path.relative_to(repo)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def graph_key(layer: torch.nn.Module, kind: str, kv_cache: torch.Tensor, meta, options: dict | None) -> str:
    """Everything a saved graph depends on that can differ between runs, hashed."""
    from attention import cpp_build, decode_cpu

    parts = {
        "kind": kind,
        "layer": repr(layer),  # module types (merged, panel or oneDNN linears), shapes, biases, norms
        "constants": {n: v for m in layer.modules() for n, v in vars(m).items() if isinstance(v, (int, float, bool, str))},
        "dtype": str(next(layer.parameters()).dtype),
        "kv_cache": [list(kv_cache.shape), str(kv_cache.dtype), str(kv_cache.device)],
        "backend": meta.backend,
        "decode_kernel": decode_cpu.kernel_available(),
        "options": options or {},
        "torch": torch.__version__,
        "python": platform.python_version(),  # the saved graph carries Dynamo's rewritten bytecode
        "threads": torch.get_num_threads(),  # Inductor writes the thread count into its C++ loops
        "cpu": cpp_build.cpu_flags(),  # Inductor's C++ is built for this CPU (-march=native), as our kernels
        "sources": _sources_digest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


class PrecompiledLayers:
    """Runs decoder layers through saved graphs, once `install`ed on them."""

    def __init__(self, forward, options: dict | None, directory: Path | None = None):
        self.forward = forward  # the layer class's forward, unbound: one graph serves every layer
        self.options = options
        self.directory = directory or cache_root() / "precompiled"
        self.graphs: dict[bool, object] = {}
        self.sources: dict[str, str] = {}  # step kind -> "loaded", "compiled" or "jit", for logs and tests
        self.seconds = 0.0  # spent loading and compiling

    def install(self, layers) -> None:
        # The layer holds only a module-level function and a number: Dynamo pickles the layer's
        # attributes with the guards it saves, and this object holds graphs, which do not pickle.
        index = next(_NUMBERS)
        _INSTALLED[index] = self
        for layer in layers:
            layer.forward = functools.partial(_run, index, layer)

    def __call__(self, layer, rope, x, kv_cache, meta):
        graph = self.graphs.get(meta.decode_only)
        if graph is not None:
            return graph(layer, rope, x, kv_cache, meta)
        start = time.perf_counter()
        kind = KINDS[meta.decode_only]
        graph = self.graphs[meta.decode_only] = self._load_or_compile(kind, layer, rope, x, kv_cache, meta)
        out = graph(layer, rope, x, kv_cache, meta)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        log.info("%s the %s-step decoder-layer graph in %.1f s (first run included)", self.sources[kind], kind, seconds)
        return out

    def _load_or_compile(self, kind, layer, rope, x, kv_cache, meta):
        path = self.directory / f"layer-{kind}-{graph_key(layer, kind, kv_cache, meta, self.options)}.aot"
        graph = self._load(path)
        if graph is not None:
            self.sources[kind] = "loaded"
        else:
            try:
                graph = self._compile((layer, rope, x, kv_cache, meta))
            except Exception as e:
                log.warning("precompiling the %s-step decoder-layer graph failed (%s: %s); using torch.compile's JIT "
                            "path for it", kind, type(e).__name__, e)
                graph = torch.compile(self.forward, fullgraph=True, dynamic=True, options=self.options)
                self.sources[kind] = "jit"
                return graph  # compiled on its first call
            self._save(graph, path)
            self.sources[kind] = "compiled"
        return graph

    def _load(self, path: Path):
        if not path.exists():
            return None
        try:
            # Guards are rebuilt against the current dispatch state: load as the graphs are called.
            with path.open("rb") as f, torch.inference_mode():
                graph = torch.compiler.load_compiled_function(f)
        except Exception as e:  # a file from a crashed write or an incompatible build: compile anew
            log.warning("could not load the precompiled graph %s (%s: %s); compiling it again", path, type(e).__name__, e)
            return None
        graph.disable_guard_check()  # the key and the step kind stand in for them (module docstring)
        return graph

    def _compile(self, example):
        # Float constants (eps, scale) become graph constants, as the key records them; left symbolic,
        # aot_compile stops at Dynamo's float-tensorify restart, which only the JIT path handles.
        with torch._dynamo.config.patch(specialize_float=True):
            compiled = torch.compile(self.forward, fullgraph=True, dynamic=True, options=self.options)
            graph = compiled.aot_compile((example, {}))
        graph.disable_guard_check()
        return graph

    def _save(self, graph, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            graph.save_compiled_function(str(path))  # written whole or not at all (a rename)
        except Exception as e:  # the graph still serves this process; the next start compiles again
            log.warning("could not save the precompiled graph to %s (%s: %s)", path, type(e).__name__, e)


_INSTALLED: weakref.WeakValueDictionary[int, PrecompiledLayers] = weakref.WeakValueDictionary()  # held by runners
_NUMBERS = itertools.count()


def _run(index: int, layer, rope, x, kv_cache, meta):
    return _INSTALLED[index](layer, rope, x, kv_cache, meta)
