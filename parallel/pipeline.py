"""Pipeline parallelism's stage split: which layers each stage holds, and the model cut to one stage.

A stage is a run of consecutive decoder layers; the first stage also holds the embedding, the last
the final norm and the lm_head (with tied embeddings the last stage holds the tied tensor as its
lm_head, so both ends have it). The split is applied from outside the model code, on the meta model
before any weight is read (`split_stage`), so loading reads only the stage's own tensors
(`StageSplit.skips`) and its KV cache holds only its layers. The model's forward runs whatever it
holds: a stage without the embedding continues from the hidden states it is given, one without the
lm_head returns every token's hidden state (toolkit/models/llama.py).

The default split is vLLM's (`get_pp_indices`): layers // pp each, the leftover layers one each to
the stages before the last, from the second-to-last backwards (the last stage also runs the norm and
the lm_head). `pp_layer_partition="4,4,5,3"` overrides it.

Leaf module: torch only; it reads the model's module names, never imports toolkit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from toolkit.parallel.distributed import ParallelConfigError

LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.")


def layer_partition(num_layers: int, pp: int, partition: str | None = None) -> list[int]:
    """Layers per stage: `partition` ("4,4,5,3") when given, else vLLM's even split. Raises
    ParallelConfigError (before any weight is read) for a partition or a size that cannot work."""
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ParallelConfigError(f"pipeline_parallel_size must be an integer >= 1, got {pp!r}")
    if pp > num_layers:
        raise ParallelConfigError(f"pipeline_parallel_size {pp} is more than the model's {num_layers} layers: "
                                  "every stage needs at least one layer")
    if partition is None:
        sizes = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            sizes[-i] += 1
        return sizes
    try:
        sizes = [int(part) for part in str(partition).split(",")]
    except ValueError:
        raise ParallelConfigError(f"pp_layer_partition must be comma-separated layer counts such as '4,4,5,3', "
                                  f"got {partition!r}") from None
    if len(sizes) != pp:
        raise ParallelConfigError(f"pp_layer_partition {partition!r} has {len(sizes)} stages but "
                                  f"pipeline_parallel_size is {pp}")
    if min(sizes) < 1:
        raise ParallelConfigError(f"pp_layer_partition {partition!r}: every stage needs at least one layer")
    if sum(sizes) != num_layers:
        raise ParallelConfigError(f"pp_layer_partition {partition!r} sums to {sum(sizes)} layers but the model has "
                                  f"{num_layers}")
    return sizes


@dataclass(frozen=True)
class StageSplit:
    """Stage `index` of `size`: its layers and whether it holds the embedding or the head."""

    index: int
    size: int
    layers: range
    tied_embeddings: bool = False

    @classmethod
    def of(cls, index: int, sizes: list[int], tied_embeddings: bool = False) -> "StageSplit":
        start = sum(sizes[:index])
        return cls(index, len(sizes), range(start, start + sizes[index]), tied_embeddings)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def describe(self) -> str:
        ends = [what for what, held in (("embedding", self.is_first), ("norm + lm_head", self.is_last)) if held]
        return (f"pipeline stage {self.index + 1} of {self.size}: layers {self.layers.start}-{self.layers.stop - 1}"
                + (f" and the {' and '.join(ends)}" if ends else ""))

    def holds_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to this stage (the loader skips the rest)."""
        layer = LAYER_TENSOR.match(name)
        if layer is not None:
            return int(layer[1]) in self.layers
        if name.startswith("model.embed_tokens."):
            # A tied checkpoint's embedding is also the last stage's lm_head (weights.load_weights).
            return self.is_first or (self.is_last and self.tied_embeddings)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.is_last
        return True

    def skips(self, name: str) -> bool:
        return not self.holds_tensor(name)


def split_stage(model: nn.Module, stage: StageSplit) -> nn.Module:
    """Cut a (meta) decoder model down to `stage`: other stages' layers removed, the embedding kept
    on the first stage only, the final norm and lm_head on the last only."""
    layers = model.model.layers
    for key in [k for k in layers if int(k) not in stage.layers]:
        del layers[key]
    if not stage.is_first:
        model.model.embed_tokens = None
    if not stage.is_last:
        model.model.norm = None
        model.lm_head = None
    return model
