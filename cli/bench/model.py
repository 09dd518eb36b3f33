"""The benchmark's models: a folder given by the user, or a named shape written here.

`--model-shape 125m` is the issue's benchmark model: a seeded random ~125M-parameter Llama in
bfloat16; `--model-shape moe-0.5b` a Qwen3-MoE of the same attention with 16 experts of which 2 serve
each token (~0.52B parameters, ~100M active per token besides the embedding lookup). Alone, only its config.json is written and our engine fills the weights with
`load_format="dummy"`. When a peer runs too, a real safetensors checkpoint is written once
(transformers' LlamaForCausalLM, a fixed seed, save_pretrained in bfloat16) and cached, and every
system, ours included, loads that same checkpoint so all run identical weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

_BASE = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    intermediate_size=2048,
    vocab_size=32000,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# name -> (transformers config and model class name, config fields)
SHAPES = {
    "125m": ("LlamaForCausalLM", _BASE),
    "moe-0.5b": ("Qwen3MoeForCausalLM", dict(_BASE, head_dim=64, num_experts=16, num_experts_per_tok=2,
                                             moe_intermediate_size=1024, norm_topk_prob=True)),
}
SEED = 0


def cache_root() -> Path:
    return Path(os.environ.get("TOOLKIT_BENCH_CACHE", Path.home() / ".cache" / "toolkit" / "bench"))


def shape_config(shape: str):
    import transformers

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    architecture, fields = SHAPES[shape]
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(**fields, architectures=[architecture])
    config.dtype = torch.bfloat16
    return config


def _folder(shape: str) -> str:
    return shape if shape.startswith("moe") else f"llama-{shape}"


def shape_config_only(shape: str) -> Path:
    """A folder holding only config.json: enough for our engine's load_format='dummy'."""
    config = shape_config(shape)  # an unknown name fails here, before any folder is made
    path = cache_root() / f"{_folder(shape)}-config"
    if not (path / "config.json").is_file():
        path.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(path)
    return path


def shape_checkpoint(shape: str) -> Path:
    """A real bf16 safetensors checkpoint of the shape, seeded; written once, then reused."""
    import transformers

    config = shape_config(shape)
    path = cache_root() / f"{_folder(shape)}-seed{SEED}"
    done = path / ".complete"
    if done.is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = getattr(transformers, config.architectures[0])(config).to(torch.bfloat16).eval()
    model.save_pretrained(path, safe_serialization=True)
    done.write_text(json.dumps({"shape": shape, "seed": SEED}))
    return path


def resolve_model(model: Path | None, shape: str | None, need_weights: bool) -> tuple[Path, str]:
    """(model folder, our load_format) from --model / --model-shape."""
    if (model is None) == (shape is None):
        raise ValueError("give exactly one of --model PATH or --model-shape NAME")
    if model is not None:
        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"no config.json in model folder {model}")
        return Path(model), "safetensors"
    if need_weights:
        return shape_checkpoint(shape), "safetensors"
    return shape_config_only(shape), "dummy"
