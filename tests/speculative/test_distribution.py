"""End to end: with speculation, the joint distribution of the first sampled tokens is the exact one
computed from transformers' logits on the same weights (Pearson's chi-square, goodness_of_fit.py).

An 8-token vocabulary makes the exact distribution of the first four tokens computable (4096
sequences); the draft is a different random model, so drafts are often rejected and the residual
distribution, the bonus token and the acceptance test all shape the result."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.checkpoints import write_checkpoint
from tests.speculative.goodness_of_fit import ALPHA, chi_square_p_value
from toolkit import LLM, SamplingParams

VOCAB = 8
PROMPT = [3, 4, 5, 3, 4]
NUM_TOKENS = 4  # the prefill samples the first; one verify step of 2 drafts gives up to 3 more
SAMPLES = 6000


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vocab")
    target = write_checkpoint(root / "target", "llama3", seed=1, vocab_size=VOCAB)
    draft = write_checkpoint(root / "draft", "llama3", seed=9, vocab_size=VOCAB, num_hidden_layers=1)
    return target, draft, exact_joint(target), exact_joint(draft)


@torch.no_grad()
def exact_joint(path) -> torch.Tensor:
    """P(x1..x4 | PROMPT) at temperature 1, as [V, V, V, V], from transformers' next-token logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    joint = torch.ones(())
    for length in range(NUM_TOKENS):
        prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=length)) or [[]], dtype=torch.long)
        ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes.view(len(prefixes), length)], 1)
        nxt = model(input_ids=ids).logits[:, -1].softmax(-1).view(*([VOCAB] * length), VOCAB)
        joint = joint.unsqueeze(-1) * nxt
    return joint


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_first_tokens_have_the_exact_joint_distribution(models, method):
    target, draft, exact, draft_exact = models
    config = {"method": method, "num_speculative_tokens": 2}
    if method == "draft_model":
        config["model"] = str(draft)
    llm = LLM(str(target), dtype="float32", max_model_len=32, enforce_eager=True, skip_tokenizer_init=True,
              speculative_config=config, seed=5)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * SAMPLES,
                        SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True), use_tqdm=False)
    seqs = torch.tensor([o.outputs[0].token_ids for o in outs])
    stats = llm.engine.stats()["spec_decode"]
    assert stats["num_drafts"] > SAMPLES // 2 and 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    first3 = torch.bincount(seqs[:, 0] * VOCAB**2 + seqs[:, 1] * VOCAB + seqs[:, 2], minlength=VOCAB**3)
    assert chi_square_p_value(first3, exact.sum(-1)) > ALPHA
    last = torch.bincount(seqs[:, 3], minlength=VOCAB)
    assert chi_square_p_value(last, exact.sum((0, 1, 2))) > ALPHA
    # The test has power: the draft model's own distribution, which keeping every draft would give, is
    # rejected on the same data.
    assert chi_square_p_value(first3, draft_exact.sum(-1)) < 1e-6
