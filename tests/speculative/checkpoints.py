"""Drafts for the speculative tests: the target with its weights perturbed, so that it agrees with the
target often but not always (both the accept and the reject paths run), written with save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch


def write_perturbed_draft(target: Path, path: Path, scale: float = 0.3, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    model.save_pretrained(path, safe_serialization=True)
    return path


def repetitive_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt followed by its own start again: n-gram lookup then has something to find."""
    return [p + p[: max(3, len(p) // 2)] for p in prompts]
