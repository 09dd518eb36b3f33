"""Build a model on the meta device and fill it from safetensors files.

The model is constructed under accelerate's `init_empty_weights`, so no random initialization
is ever paid; each tensor is then read once from the checkpoint, cast to the serving dtype and
put in place. A checkpoint that does not match the model exactly (a missing tensor, an unknown
one, a wrong shape) is an error naming the tensor: serving silently wrong weights is worse.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import SafetensorError, safe_open
from torch import nn

from toolkit.config import ModelConfig
from toolkit.models import MODEL_CLASSES

# Tensors some checkpoints carry that are recomputed here, not loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# (parameter name, safetensors slice) -> the tensor this process keeps. The default reads it all;
# a tensor-parallel plan passes one that reads only this rank's shard.
SliceReader = Callable[[str, object], torch.Tensor]


class CheckpointError(ValueError):
    """The checkpoint's files or tensors do not match the model."""


@contextmanager
def open_checkpoint_file(file: Path):
    """safe_open, with a truncated or corrupt file reported as a CheckpointError naming it."""
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except SafetensorError as e:
        raise CheckpointError(f"{file} is not a readable safetensors file ({e}): it may be truncated or "
                              "corrupt; download or save the checkpoint again") from None
    with handle as f:
        yield f


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: sharded (with an index) or a single file."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shard missing: {', '.join(missing)}")
    return files


def build_model(config: ModelConfig, max_positions: int) -> nn.Module:
    """The model with parameters on the meta device (buffers such as RoPE tables are real)."""
    with init_empty_weights(include_buffers=False):
        model = MODEL_CLASSES[config.architecture](config, max_positions)
    return model


def load_weights(
    model: nn.Module,
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    read_slice: SliceReader | None = None,
) -> None:
    read_slice = read_slice or (lambda name, sl: sl[:])
    params = dict(model.named_parameters())
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight", None)  # tied to the embedding after loading
    loaded: set[str] = set()
    for file in checkpoint_files(path):
        with open_checkpoint_file(file) as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES) or (name not in params and _is_tied_alias(model, name)):
                    continue
                if name not in params:
                    raise CheckpointError(f"unexpected tensor {name!r} in {file.name}: the model has no such parameter")
                tensor = read_slice(name, f.get_slice(name))
                expected = tuple(params[name].shape)
                if tuple(tensor.shape) != expected:
                    raise CheckpointError(
                        f"shape mismatch for {name!r} in {file.name}: checkpoint {tuple(tensor.shape)}, model {expected}"
                    )
                # dtype must be given: accelerate otherwise keeps the meta parameter's (float32) dtype.
                set_module_tensor_to_device(model, name, device, value=tensor, dtype=dtype)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {path} lacks tensors the model needs: {shown}")


def _is_tied_alias(model: nn.Module, name: str) -> bool:
    """`lm_head.weight` in a tied checkpoint: the same tensor as the embedding, loaded once."""
    return name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)


LOAD_FORMATS = ("safetensors", "dummy")


def load_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int, load_format: str = "safetensors",
    tp=None,
) -> nn.Module:
    """`load_format="dummy"` fills seeded random weights instead of reading files (benchmarks of model shapes).

    `tp` (a `parallel.TensorParallel`, or None) gives the meta model this rank's shard shapes before
    loading and reads only this rank's slices; `transforms.apply` installs the DTensor plan after.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
    model = build_model(config, max_positions)
    if tp is not None:
        tp.shard_meta(model)
    if load_format == "dummy":
        fill_random(model, dtype, device, std=getattr(config.hf_config, "initializer_range", 0.02))
    else:
        load_weights(model, config.path, dtype, device, read_slice=tp.read_slice if tp is not None else None)
    model.tie_weights()
    return model.to(device).eval().requires_grad_(False)


def fill_random(model: nn.Module, dtype: torch.dtype, device: torch.device, std: float, seed: int = 0) -> None:
    # Drawn on the target device: an 8B model's worth of host randn would dominate start-up.
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in list(model.named_parameters()):
        if name.endswith("norm.weight"):
            value = torch.ones(param.shape, device=device)
        else:
            value = torch.randn(param.shape, generator=generator, device=device) * std
        set_module_tensor_to_device(model, name, device, value=value, dtype=dtype)
