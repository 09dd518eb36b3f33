"""Build a model on the meta device and fill it from safetensors files (or one GGUF file).

The model is constructed under accelerate's `init_empty_weights`, so no random initialization
is ever paid; each tensor is then read once from the checkpoint, cast to the serving dtype and
put in place. A checkpoint that does not match the model exactly (a missing tensor, an unknown
one, a wrong shape) is an error naming the tensor: serving silently wrong weights is worse.

A GGUF file (toolkit/gguf_checkpoint.py) is read through the same loop: its tensors are offered under
Hugging Face names with the slice interface of safetensors, de-quantized as they are read.

Mixture-of-experts checkpoints hold one tensor per expert and projection
(`...experts.{e}.{gate|up|down}.weight`, the names in `Experts.checkpoint_names`); the model holds
them stacked (`Experts.w13 [E_local, 2*I, H]`, gate rows then up rows, and `w2 [E_local, H, I]`), so
each is copied into its expert's rows (vLLM's expert_params_mapping). A layer holding only experts
`[first_expert, first_expert + E_local)` (expert parallelism) reads only theirs.
"""

from __future__ import annotations

import json
import re
import zlib
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
from toolkit.models.moe import Experts

# Tensors some checkpoints carry that are recomputed here, not loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# (parameter name, safetensors slice) -> the tensor this process keeps. The default reads it all;
# a tensor-parallel plan passes one that reads only this rank's shard.
SliceReader = Callable[[str, object], torch.Tensor]
# checkpoint tensor name -> True where this process does not hold it (e.g. another rank's expert).
SkipTensor = Callable[[str], bool]
EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.weight$")


class CheckpointError(ValueError):
    """The checkpoint's files or tensors do not match the model."""


@contextmanager
def open_checkpoint_file(file: Path):
    """safe_open, with a truncated or corrupt file reported as a CheckpointError naming it; a GGUF
    file's tensors under Hugging Face names (the same `keys()` and `get_slice(name)`)."""
    if file.suffix.lower() == ".gguf":
        from toolkit.gguf_checkpoint import GGUFTensors

        yield GGUFTensors(file)
        return
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except SafetensorError as e:
        raise CheckpointError(f"{file} is not a readable safetensors file ({e}): it may be truncated or "
                              "corrupt; download or save the checkpoint again") from None
    with handle as f:
        yield f


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: sharded (with an index) or a single file; a GGUF file is its own."""
    path = Path(path)
    if path.suffix.lower() == ".gguf" and path.is_file():
        return [path]
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
    with init_empty_weights(include_buffers=False), _no_random_init():
        model = MODEL_CLASSES[config.architecture](config, max_positions)
    return model


RANDOM_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_normal_", "kaiming_uniform_", "xavier_normal_",
                "xavier_uniform_")


@contextmanager
def _no_random_init():
    """Modules' random initialization skipped while the model is built: every weight comes from the
    checkpoint. Not only wasted work: on a meta tensor `normal_` (nn.Embedding's) runs through torch's
    Python references, which import Dynamo: an import that an eager run otherwise never pays."""
    saved = {name: getattr(nn.init, name) for name in RANDOM_INITS}
    for name in RANDOM_INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def load_weights(
    model: nn.Module,
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    read_slice: SliceReader | None = None,
    skip: SkipTensor | None = None,
) -> None:
    """Fill `model`'s parameters from the checkpoint at `path`. `read_slice(name, slice)` reads the part
    of a checkpoint tensor this process keeps (tensor parallelism: its shard; for an expert's tensor its
    result is checked against, and copied into, that expert's rows of the stacked parameter);
    `skip(name)` names checkpoint tensors not read at all."""
    read_slice = read_slice or (lambda name, sl: sl[:])
    params = dict(model.named_parameters())
    # Tied embeddings: lm_head is the embedding, tied after loading; a last pipeline stage holds the
    # lm_head without the embedding (parallel/pipeline.py) and reads the embedding's tensor into it.
    aliases = {}
    if model.config.tie_word_embeddings and "model.embed_tokens.weight" in params:
        params.pop("lm_head.weight", None)
    elif model.config.tie_word_embeddings and "lm_head.weight" in params:
        aliases["model.embed_tokens.weight"] = "lm_head.weight"
    stacks = _ExpertStacks(model, dtype, device)
    loaded: set[str] = set()
    for file in checkpoint_files(path):
        with open_checkpoint_file(file) as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES) or (name not in params and _is_tied_alias(model, name)):
                    continue
                if skip is not None and skip(name):
                    continue
                key = name  # the checkpoint's name; `name` is the parameter's
                if name in aliases:
                    if aliases[name] in loaded:
                        continue  # the checkpoint also holds lm_head.weight itself
                    name = aliases[name]
                if name not in params and stacks.owns(name):
                    stacks.load(name, file, lambda: read_slice(name, f.get_slice(name)))
                    continue
                if name not in params:
                    raise CheckpointError(f"unexpected tensor {name!r} in {file.name}: the model has no such parameter")
                tensor = read_slice(name, f.get_slice(key))
                expected = tuple(params[name].shape)
                if tuple(tensor.shape) != expected:
                    raise CheckpointError(
                        f"shape mismatch for {name!r} in {file.name}: checkpoint {tuple(tensor.shape)}, model {expected}"
                    )
                # dtype must be given: accelerate otherwise keeps the meta parameter's (float32) dtype.
                set_module_tensor_to_device(model, name, device, value=tensor, dtype=dtype)
                loaded.add(name)
    loaded |= stacks.finish()
    missing = sorted(set(params) - loaded - stacks.params) + stacks.missing()
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {path} lacks tensors the model needs: {shown}")


class _ExpertStacks:
    """Per-expert checkpoint tensors copied into the stacked `Experts` parameters of `model`."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device):
        self.model, self.dtype, self.device = model, dtype, device
        self.experts = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
        self.params = {f"{name}.{p}" for name in self.experts for p in ("w13", "w2")}
        self.values: dict[str, torch.Tensor] = {}  # stacked parameter name -> the tensor being filled
        self.filled: dict[str, set[tuple[int, int]]] = {p: set() for p in self.params}  # (local expert, part)

    def owns(self, name: str) -> bool:
        match = EXPERT_TENSOR.match(name)
        return match is not None and match["experts"] in self.experts

    def load(self, name: str, file: Path, read: Callable[[], torch.Tensor]) -> None:
        match = EXPERT_TENSOR.match(name)
        module_name, expert, proj = match["experts"], int(match["expert"]), match["proj"]
        experts = self.experts[module_name]
        if proj not in experts.checkpoint_names or expert >= experts.num_experts:
            raise CheckpointError(f"unexpected tensor {name!r} in {file.name}: the model has no such parameter")
        local = expert - experts.first_expert
        if not 0 <= local < experts.num_local_experts:
            return  # another rank's expert
        part = experts.checkpoint_names.index(proj)  # 0 gate, 1 up (the halves of w13), 2 down (w2)
        pname = f"{module_name}.{'w2' if part == 2 else 'w13'}"
        param = experts.w2 if part == 2 else experts.w13
        rows = param.shape[1] if part == 2 else param.shape[1] // 2
        expected = (rows, param.shape[2])
        tensor = read()
        if tuple(tensor.shape) != expected:
            raise CheckpointError(f"shape mismatch for {name!r} in {file.name}: checkpoint {tuple(tensor.shape)}, "
                                  f"model {expected} (expert {expert} of {pname})")
        if pname not in self.values:
            self.values[pname] = torch.empty(tuple(param.shape), dtype=self.dtype, device=self.device)
        start = rows if part == 1 else 0
        self.values[pname][local, start:start + rows].copy_(tensor)
        self.filled[pname].add((local, part))

    def finish(self) -> set[str]:
        """Put every completely filled stack in place; returns their names."""
        done = set()
        for pname, value in self.values.items():
            if len(self.filled[pname]) == value.shape[0] * (1 if pname.endswith(".w2") else 2):
                set_module_tensor_to_device(self.model, pname, self.device, value=value, dtype=self.dtype)
                done.add(pname)
        return done

    def missing(self) -> list[str]:
        """The checkpoint names of the expert tensors no file held."""
        names = []
        for module_name, experts in self.experts.items():
            gate, up, down = experts.checkpoint_names
            for local in range(experts.num_local_experts):
                e = experts.first_expert + local
                for pname, part, proj in (("w13", 0, gate), ("w13", 1, up), ("w2", 2, down)):
                    if (local, part) not in self.filled[f"{module_name}.{pname}"]:
                        names.append(f"{module_name}.{e}.{proj}.weight")
        return names


def _is_tied_alias(model: nn.Module, name: str) -> bool:
    """`lm_head.weight` in a tied checkpoint: the same tensor as the embedding, loaded once."""
    return name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)


LOAD_FORMATS = ("safetensors", "dummy")


def load_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int, load_format: str = "safetensors",
    tp=None, ep=None, stage=None,
) -> nn.Module:
    """`load_format="dummy"` fills seeded random weights instead of reading files (benchmarks of model shapes).

    `tp` (a `parallel.TensorParallel`, or None) gives the meta model this rank's shard shapes before
    loading and reads only this rank's slices; `transforms.apply` installs the DTensor plan after.
    `ep` (a `parallel.ExpertParallel`, or None) gives every `Experts` only this rank's experts (and
    their `first_expert`) first, so only their tensors are read.
    `stage` (a `parallel.pipeline.StageSplit`, or None) cuts the meta model to one pipeline stage's
    layers and ends first, so only the stage's tensors are read.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
    model = build_model(config, max_positions)
    if stage is not None:
        from toolkit.parallel.pipeline import split_stage

        split_stage(model, stage)
    if ep is not None:
        ep.shard_meta(model)
    if tp is not None:
        tp.shard_meta(model)
    if load_format == "dummy":
        fill_random(model, dtype, device, std=getattr(config.hf_config, "initializer_range", 0.02))
    else:
        load_weights(model, config.path, dtype, device, read_slice=tp.read_slice if tp is not None else None,
                     skip=stage.skips if stage is not None else None)
    model.tie_weights()
    return model.to(device).eval().requires_grad_(False)


def fill_random(model: nn.Module, dtype: torch.dtype, device: torch.device, std: float, seed: int = 0) -> None:
    # Drawn on the target device: an 8B model's worth of host randn would dominate start-up. Each tensor
    # is seeded by its name, so a pipeline stage draws the same weights the whole model would.
    generator = torch.Generator(device=device)
    for name, param in list(model.named_parameters()):
        if name.endswith("norm.weight"):
            value = torch.ones(param.shape, device=device)
        else:
            generator.manual_seed(seed + zlib.crc32(name.encode()))
            value = torch.randn(param.shape, generator=generator, device=device) * std
        set_module_tensor_to_device(model, name, device, value=value, dtype=dtype)
