"""Mixture-of-experts MLPs: Mixtral, Qwen2-MoE (with a gated shared expert) and Qwen3-MoE.

A decoder layer of those families is the dense family's (toolkit/models/llama.py: the same attention
and norms) with a `SparseMoE` as its MLP on the layers the config makes sparse. Routing follows
transformers exactly:

- the router (`gate`, a Linear H -> E) gives logits in the model's dtype; softmax in float32;
- the top-k experts by probability, their weights renormalized to sum 1 (Mixtral always; Qwen2-MoE
  and Qwen3-MoE only with `norm_topk_prob`); Qwen's weights are then rounded to the model's dtype
  (transformers casts them there), Mixtral's stay float32;
- each token's output is the weighted sum of its experts' SwiGLU MLPs (`Experts`, one custom op for
  the whole layer: toolkit/moe/ops.py), plus, for Qwen2-MoE, the shared expert scaled by
  `sigmoid(shared_expert_gate(x))`.

The experts are held stacked, `w13 [E_local, 2*I, H]` (gate rows then up rows) and `w2 [E_local, H, I]`;
weights.py stacks the checkpoint's per-expert tensors into them. Expert parallelism gives a layer
only some experts (`first_expert`, E_local < E) and a `dispatcher` from outside (parallel/), and the
CPU backend one that calls its kernel straight (toolkit/backends/cpu/experts.py); the model code
knows nothing of either.
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit.config import ModelConfig
from toolkit.models.logits import Float32Logits
from toolkit.moe.ops import moe_experts

# Per family: the MoE block's name in a decoder layer, and each expert's (gate, up, down) tensor names
# in the checkpoint (`{layer}.{block}.experts.{e}.{name}.weight`).
CHECKPOINT_LAYOUT = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


class Experts(nn.Module):
    """The routed experts of one layer, stacked. `tokens_per_expert` counts the (token, slot) pairs
    routed to each (global) expert since the model was built."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 num_local_experts: int | None = None, first_expert: int = 0):
        super().__init__()
        local = num_experts if num_local_experts is None else num_local_experts
        self.num_experts = num_experts  # global E
        self.first_expert = first_expert  # global id of local expert 0
        self.checkpoint_names = checkpoint_names  # (gate, up, down) of each expert in the checkpoint
        self.w13 = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, intermediate_size))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        # Set from outside (expert or tensor parallelism, the CPU backend): (experts, x, weights, ids) -> [T, H]
        self.dispatcher = None

    @property
    def num_local_experts(self) -> int:
        return self.w13.shape[0]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights [T, k] float32, topk_ids [T, k] int64 (global ids) -> [T, H] in x's dtype."""
        if self.dispatcher is not None:
            return self.dispatcher(self, x, topk_weights, topk_ids)
        return moe_experts(x, self.w13, self.w2, topk_weights, topk_ids, self.first_expert, self.tokens_per_expert)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, local=[{self.first_expert}, "
                f"{self.first_expert + self.num_local_experts}), hidden={self.w13.shape[2]}, "
                f"intermediate={self.w2.shape[2]}")


class SparseMoE(nn.Module):
    """Router, routed experts and (Qwen2-MoE) the gated shared expert: `shared_expert` is the dense
    MLP module the caller builds at the shared expert's size."""

    def __init__(self, config: ModelConfig, shared_expert: nn.Module | None = None):
        super().__init__()
        moe = config.moe
        h = config.hidden_size
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.weights_in_model_dtype = moe.weights_in_model_dtype
        # Router logits in float32 (as the lm_head's): near-tied experts keep float32's order.
        self.gate = Float32Logits(h, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, h, moe.intermediate_size, CHECKPOINT_LAYOUT[config.family][1])
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token, the top_k experts' ids [T, k] (int64) and weights [T, k] (float32)."""
        probs = torch.softmax(self.gate(x), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype).float()
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def expert_token_counts(model: nn.Module) -> list[tuple[int, torch.Tensor]]:
    """(layer index, its Experts' tokens_per_expert) for every MoE layer of a decoder model, in order."""
    counts = []
    for i, layer in model.model.layers.items():
        block = getattr(layer, layer.mlp_name, None)
        if isinstance(block, SparseMoE):
            counts.append((int(i), block.experts.tokens_per_expert))
    return counts
