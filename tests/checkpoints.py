"""Small seeded random checkpoints in Hugging Face layout, written with transformers' save_pretrained.

Every family the toolkit serves has one here; tests compare the toolkit against transformers on
exactly these weights. The initializer range is raised to 0.1 so logits are far from flat and
greedy argmax does not flip on float noise.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 384

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES = {
    # Llama-3 RoPE scaling (the long-context frequency remapping), GQA 4:2.
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Mistral, MHA; its sliding window is wider than any sequence served.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=4, sliding_window=4096)),
    # Qwen2: q/k/v biases.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    # Qwen3: q/k RMSNorm, and a head_dim that is not hidden/heads.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    # Tied embeddings with MQA (one kv head).
    "tied_mqa": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1)),
}

# Mixture-of-experts families (toolkit/models/moe.py), apart from FAMILIES so the suites parametrized over
# every dense family keep their cost; tests/toolkit/test_moe.py runs these. 8 experts, top-2, 3 layers.
MOE = dict(num_hidden_layers=3, num_experts_per_tok=2)
MOE_FAMILIES = {
    # Mixtral: every layer sparse, top-k weights always renormalized; intermediate_size is an expert's.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(MOE, num_local_experts=8, intermediate_size=32)),
    # Qwen2-MoE: q/k/v biases, a gated shared expert, layer 1 dense (mlp_only_layers), weights not renormalized.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1],
        norm_topk_prob=False)),
    # Qwen3-MoE: q/k norm, head_dim 32, renormalized top-k weights.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        MOE, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32)),
    # Qwen3-MoE without renormalization, every second layer sparse (decoder_sparse_step 2).
    "qwen3_moe_step2": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        MOE, num_experts=8, moe_intermediate_size=32, norm_topk_prob=False, decoder_sparse_step=2)),
}


def write_checkpoint(path: Path, family: str, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    import transformers

    config_cls, model_cls, extra = FAMILIES[family] if family in FAMILIES else MOE_FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def random_prompts(n: int, seed: int, low: int = 3, high: int = 40, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    # Ids from 3 up: no pad/bos/eos inside prompts.
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own generate, one prompt at a time (no padding), stopping at EOS like the engine."""
    from transformers import AutoModelForCausalLM

    return model_greedy(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), prompts, max_new_tokens)


def model_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """A transformers model's greedy generate, one prompt at a time (no padding), stopping at its EOS."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "the cat sat on the mat and the dog ran in the park",
    "a list comprehension builds a list from an iterable in one expression",
    "python functions return values; a generator yields them one at a time",
    "hello world, this is a small tokenizer for tests",
]


def write_tokenizer(path: Path, vocab_size: int = VOCAB) -> Path:
    """A byte-level BPE tokenizer trained here (no downloads), with <pad>=0, <s>=1, </s>=2 and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path
