"""Every change made to a model after loading, in one function and one visible order (`apply`).

The model code (toolkit/models/) is plain PyTorch and knows nothing of what follows; each change is
applied from outside, as torchtitan's `parallelize_llama` does:

1. Tensor parallel: this rank's loaded slices become DTensors and the plan's redistributions are
   installed (parallel/tensor_parallel.py). Loading already read only this rank's slices.
   Expert parallel (MoE models, enable_expert_parallel): every layer's `Experts` gets the all-to-all
   dispatcher (parallel/expert_parallel.py); loading already read only this rank's experts.
2. Merged linears: q/k/v and gate/up, which read the same input, become one matmul each
   (toolkit/merged_linear.py), where no TP plan shards them apart.
3. Weight-only int8 (quantization="int8"): every linear but the MoE routers quantized, per output
   channel (toolkit/quantization.py).
4. The device backend's changes (toolkit/backends): on CPU the linears' weight layouts for the
   kernels the machine chose.
5. Compile: the whole step (embedding to logits) as one torch.compile'd graph, unless enforce_eager.
6. The device backend's replay of decode steps: CUDA graphs on CUDA.

The result is a `Step`: StepInputs (toolkit/inputs.py) in, float32 logits of the sampled rows out
(a pipeline stage, parallel/pipeline.py: the previous stage's hidden states in too, and before the
last stage hidden states out; the stage was cut at loading, so no change here knows of it).
"""

from __future__ import annotations

import itertools
import logging
import os

import torch

from toolkit import compiled_cache, envs
from toolkit.merged_linear import merge_linears

log = logging.getLogger("toolkit")

_STEP_IDS = itertools.count()


class Step:
    """A model call over this engine's KV caches: the eager model or its compiled step."""

    def __init__(self, forward, kv_caches: list[torch.Tensor], compiled: bool):
        # (input_ids, positions, kv_caches, meta, logits_indices, hidden) -> logits, or a pipeline stage
        # before the last: hidden states
        self.forward = forward
        self.kv_caches = kv_caches
        # The model's float constants (eps, scale) are constants of the graph: traced as symbolic floats,
        # Dynamo would trace the whole model once more after failing to turn them into tensors.
        self._dynamo_config = torch._dynamo.config.patch(specialize_float=True) if compiled else None

    def __call__(self, inputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        args = (inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, inputs.logits_indices, hidden)
        if self._dynamo_config is None:
            return self.forward(*args)
        with self._dynamo_config:
            return self.forward(*args)


def apply(model: torch.nn.Module, kv_caches: list[torch.Tensor], config, backend, tp=None,
          ep=None) -> tuple[Step, list[str]]:
    """Apply the changes above to a loaded model, in order; returns its step and what was applied."""
    applied = []
    if tp is not None:
        tp.parallelize(model)
        applied.append(f"tensor parallel over {tp.size} ranks")
    if ep is not None:
        from toolkit.parallel.expert_parallel import apply_expert_parallel

        layers = apply_expert_parallel(model, ep)
        applied.append(f"expert parallel over {ep.size} ranks: experts {ep.experts.start}-{ep.experts.stop - 1} "
                       f"of {ep.num_experts} in {layers} layers")
    if tp is None:
        applied.append(f"{merge_linears(model)} linear groups merged")
    if config.quantization == "int8":
        from toolkit.quantization import quantize_linears

        applied.append(f"{quantize_linears(model)} linears quantized to int8 (weight-only, per output channel)")
    applied += backend.prepare_model(model, tp)
    if config.enforce_eager:
        step = Step(model, kv_caches, compiled=False)
    else:
        step = Step(compile_step(model, config, backend, tp, list(applied)), kv_caches, compiled=True)
        applied.append(f"compiled ({config.compile_backend}, options {backend.compile_options()})")
    wrapped = backend.wrap_step(step)
    if wrapped is not step:
        applied.append("decode steps replay CUDA graphs")
    log.info("model changes: %s", "; ".join(applied))
    return wrapped, applied


def compile_step(model: torch.nn.Module, config, backend, tp=None, applied: list[str] = ()):
    """The whole model as one torch.compile'd function, dynamic in every batch size (the runner marks
    them), with a Dynamo cache of its own; where it applies, kept on disk between processes
    (toolkit/compiled_cache.py; `applied`, what the changes before compiling did, is part of its key)."""

    def step(input_ids, positions, kv_caches, meta, logits_indices, hidden=None):
        return model(input_ids, positions, kv_caches, meta, logits_indices, hidden)

    # Dynamo keeps compiled code per code object, and every function made from this `def` would share
    # one: a copy of the code gives each engine a cache of its own, freed with the engine, so a process
    # that builds engine after engine never reaches Dynamo's recompile limit, and, with the guards on
    # the model dropped below, no engine can be handed a graph another engine's model was traced for.
    if compiled_cache.applies(config, backend.attention_backend(), tp):
        _use_persistent_inductor_cache()
        options = {**backend.compile_options(), "guard_filter_fn": _guards_on_inputs}
        return compiled_cache.CachedStep(step, model, options, list(applied),
                                         jit=lambda: compile_function(step, config, backend))
    return compile_function(step, config, backend)


def compile_function(fn, config, backend):
    """`fn` (a closure over one engine's model) compiled the way the step is: whole-graph, dynamic,
    the device backend's options, guards on its inputs only, and a Dynamo cache of its own (a copy
    of its code under a name of its own; see compile_step)."""
    _use_persistent_inductor_cache()
    fn.__code__ = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_STEP_IDS)}")
    options = {**backend.compile_options(), "guard_filter_fn": _guards_on_inputs}
    return torch.compile(fn, fullgraph=True, dynamic=True, backend=config.compile_backend, options=options)


def _guards_on_inputs(entries) -> list[bool]:
    """Keep the guards on the step's inputs and on global state; drop those on the model (its closure
    variable) and on imported modules. The model is this engine's own (see compile_step) and is not
    changed after `apply`, and its ~2,000 guards (every parameter and module attribute of a 12-layer
    model) were most of Dynamo's time per call (docs/benchmarks.md). What can change between steps is
    in the inputs: their dtypes, ranks and strides, the attention backend and the step kind."""
    return [not entry.name.startswith(("model", "G[")) for entry in entries]


def _use_persistent_inductor_cache() -> None:
    """Point Inductor's on-disk caches at $TOOLKIT_CACHE/inductor (default ~/.cache/toolkit/inductor),
    which outlives a reboot, unless the user chose a directory. Importing torch._dynamo (which
    something may have done already) fills the variable with torch's default under /tmp, so a
    value equal to that default counts as unset; Inductor reads the variable on every lookup."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(envs.cache_root() / "inductor")
