"""Device backends: what a device contributes to an engine, behind one entry point, `for_device`.

The rest of the toolkit never branches on the device. It asks the backend:
- `attention_backend()`: the attention kernels a step uses by default;
- `prepare_model(model, tp)`: the device's own post-load changes (CPU: the linears' weight layouts);
- `compile_options()`: Inductor's options for the compiled step (CPU: its C++ wrapper);
- `wrap_step(step)`: how decode steps are replayed (CUDA: CUDA graphs);
- `empty_kv(shape, dtype)`: how a layer's KV cache is allocated (CPU: on transparent huge pages);
- `stats()`: what it chose, for logs and `Engine.stats()`.

`Backend` itself is the generic one: torch's own ops on any device torch runs on. The CPU backend
(`toolkit/backends/cpu/`) holds every CPU-specific line: C++ kernels, their build, weight packing,
kernel choice; the CUDA one (`toolkit/backends/cuda.py`) the Triton choice and CUDA graphs.
"""

from __future__ import annotations

import torch


class Backend:
    """torch's own ops on any device: the reference every other backend is tested against."""

    name = "generic"

    def __init__(self, config, model_config):
        self.config = config  # a resolved EngineConfig (toolkit/config.py)
        self.model_config = model_config

    def attention_backend(self) -> str:
        return self.config.attention_backend or "torch"


    def prepare_model(self, model: torch.nn.Module, tp) -> list[str]:
        """Device-specific changes after loading and merging; returns what it did, for the log."""
        return []

    def compile_options(self) -> dict:
        # Inductor checks every indirect index (block table, slot) inside its loops; those come from
        # our own block pool, and the runner range-checks them once per step on the host instead.
        return {"assert_indirect_indexing": False} if self.config.compile_backend == "inductor" else {}

    def wrap_step(self, step):
        return step

    def empty_kv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.config.device)

    def stats(self) -> dict:
        return {"backend": self.name, "attention": self.attention_backend()}


def runnable(config):
    """`config` (resolved), or a copy that runs eagerly, with one warning, where compiling cannot:
    on CPU Inductor needs a C++ compiler, and without one every step would fail."""
    import dataclasses
    import logging
    import shutil

    from toolkit import envs

    if config.enforce_eager or config.compile_backend != "inductor" or torch.device(config.device).type != "cpu":
        return config
    if shutil.which(envs.cxx()) is not None:
        return config
    logging.getLogger("toolkit").warning(
        "no C++ compiler (%r, from $CXX or the default c++) to compile the model's step: running eagerly; "
        "install g++ (or set CXX) for the compiled step, or pass --eager / enforce_eager=True to silence this",
        envs.cxx())
    return dataclasses.replace(config, enforce_eager=True)


def start_early(device=None) -> None:
    """What a backend can start before any model is read, for a caller with other start-up work first
    (the CLI loads its tokenizer): on CPU, building the kernels every model uses, in compiler
    subprocesses. `device` as EngineConfig takes it (None: cuda when available, else cpu)."""
    from toolkit import envs

    on_cpu = torch.device(device).type == "cpu" if device is not None else not torch.cuda.is_available()
    if on_cpu and envs.cpu_kernels():
        from toolkit.backends.cpu import kernels

        kernels.start_build(kernels.EVERY_MODEL)


def for_device(config, model_config) -> Backend:
    """The backend for `config.device` (a resolved EngineConfig), serving `model_config`'s model.
    Raises, before any weight is read, where it cannot serve the model as configured."""
    device = torch.device(config.device)
    if device.type == "cpu":
        from toolkit.backends.cpu import CPUBackend

        return CPUBackend(config, model_config)
    if device.type == "cuda":
        from toolkit.backends.cuda import CUDABackend

        return CUDABackend(config, model_config)
    return Backend(config, model_config)
