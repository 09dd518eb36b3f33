"""The dense decoder family: Llama 1/2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norm); with
routed experts as the MLP of sparse layers (toolkit/models/moe.py), Mixtral, Qwen2-MoE and Qwen3-MoE.

Plain PyTorch, in the layout of the Hugging Face checkpoints, so weight names map one to one.
The model knows nothing of batching or parallelism: it takes the packed tokens of a whole
scheduled step (prefill chunks and decodes together, `[T]`), and attention reads and writes the
paged KV cache through the `attention` ops. Head counts come from the local weight shapes at
forward time, so a tensor-parallel plan that shards q/k/v by heads needs no change here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.attention import AttentionMetadata, paged_attention, write_kv
from toolkit.config import ModelConfig, rope_inv_freq
from toolkit.merged_linear import project
from toolkit.models.logits import Float32Logits
from toolkit.models.moe import CHECKPOINT_LAYOUT, SparseMoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, float32_output: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.float32_output = float32_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 and scale in the input dtype, as the reference implementation does; the
        # final norm, which feeds the float32 logits, scales in float32 and is never rounded.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x if self.float32_output else self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, indexed by each token's position."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config.hf_config)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Looked up once per step and shared by every layer; [T, 1, D] broadcasts over heads.
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    merge_groups = (("q_proj", "k_proj", "v_proj"),)  # they read the same x (toolkit/merged_linear.py)

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.scale = d**-0.5
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, rope, x, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q, k, v = q.view(T, -1, self.head_dim), k.view(T, -1, self.head_dim), v.view(T, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        write_kv(k, v, kv_cache, meta.slot_mapping, backend=meta.backend)
        out = paged_attention(q, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(T, -1))


class MLP(nn.Module):
    merge_groups = (("gate_proj", "up_proj"),)

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        h, i, bias = config.hidden_size, intermediate_size or config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The MLP is held under the checkpoint's name: `mlp`, or Mixtral's `block_sparse_moe`.
        self.mlp_name = "mlp"
        if config.moe is not None and config.moe.sparse_layers[layer_idx]:
            self.mlp_name = CHECKPOINT_LAYOUT[config.family][0]
            shared = config.moe.shared_expert_intermediate_size
            setattr(self, self.mlp_name, SparseMoE(config, MLP(config, shared) if shared else None))
        else:
            self.mlp = MLP(config)

    def forward(self, rope, x, kv_cache, meta):
        x = x + self.self_attn(rope, self.input_layernorm(x), kv_cache, meta)
        return x + getattr(self, self.mlp_name)(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config, max_positions)
        # Keyed by layer index, so a pipeline stage holding some of them keeps the checkpoint's names.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i) for i in range(config.num_layers)})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, float32_output=True)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata, hidden=None):
        # A pipeline stage (parallel/pipeline.py) holds a run of the layers and their KV caches: only the
        # first has the embedding (the others continue from the previous stage's `hidden`), only the last
        # the final norm.
        x = self.embed_tokens(input_ids) if self.embed_tokens is not None else hidden
        rope = self.rotary_emb(positions, x.dtype)
        for layer, kv_cache in zip(self.layers.values(), kv_caches):
            x = layer(rope, x, kv_cache, meta)
        return self.norm(x) if self.norm is not None else x


class LlamaForCausalLM(nn.Module):
    """Serves every architecture in `toolkit.config.SUPPORTED_ARCHITECTURES`."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, max_positions)
        self.lm_head = Float32Logits(config.hidden_size, config.vocab_size, bias=False)

    def tie_weights(self) -> None:
        # (A last pipeline stage without the embedding loads the tied tensor into lm_head itself.)
        if self.config.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta, logits_indices: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (float32) of the positions in `logits_indices`: the last token of each sampled request.
        A pipeline stage before the last has no lm_head: it returns every token's hidden state."""
        hidden = self.model(input_ids, positions, kv_caches, meta, hidden)
        if self.lm_head is None:
            return hidden
        return self.lm_head(hidden[logits_indices])
