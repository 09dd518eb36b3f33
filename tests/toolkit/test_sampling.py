"""The sampler on logits we control: which tokens may come out, and how often.

Distribution checks draw many rows in one batched call from a seeded engine generator, so they are
deterministic; each compares the empirical frequencies with the distribution computed by hand,
within about 4 standard deviations.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples
from toolkit.sampler import (Sampler, apply_min_p, apply_penalties, apply_temperature,
                             apply_top_k_top_p, argmax_rows, sample_rows)
from toolkit.sampling_params import SamplingParams

DRAWS = 20_000
# Four times the largest standard deviation of a frequency over DRAWS draws, 0.5 / sqrt(DRAWS).
TOLERANCE = 4 * 0.5 / math.sqrt(DRAWS)


def call(sampler, logits, params, request_ids=None, prompts=None, outputs=None):
    batch = logits.shape[0]
    params = params if isinstance(params, list) else [params] * batch
    request_ids = request_ids or [f"req-{i}" for i in range(batch)]
    for request_id, p in zip(request_ids, params):
        sampler.add_request(request_id, p)
    # The sampler only reads the token lists, so rows may share one empty list.
    return sampler(logits, request_ids, params, prompts or [[]] * batch, outputs or [[]] * batch)


def frequencies(logits_row, params, draws=DRAWS, seed=0):
    """Empirical distribution of `draws` independent samples from one row of logits."""
    logits = logits_row.unsqueeze(0).expand(draws, -1)
    tokens = call(Sampler(seed=seed), logits, params).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.numel()).double() / draws


def logits_of(probs):
    return torch.tensor(probs, dtype=torch.float64).log().float()


def max_abs_diff(empirical, expected):
    return (empirical - torch.tensor(expected, dtype=torch.float64)).abs().max().item()


def entropy(freqs):
    nonzero = freqs[freqs > 0]
    return -(nonzero * nonzero.log()).sum().item()


# --- greedy --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = call(Sampler(seed=0), logits, SamplingParams(temperature=0.0))
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16


def test_argmax_rows_is_torchs_argmax_ties_nans_and_infinities_included():
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(9))
    x[0, [5, 9]] = 100.0  # a tie: the first
    x[1, [7, 3]] = float("nan")  # NaN is the maximum: the first NaN
    x[2] = float("-inf")
    x[3, 100], x[3, 50] = float("inf"), float("nan")
    x[4, 299] = float("inf")
    for scores in (x, x.t().contiguous().t(), x[:, ::2], x[:0], x.bfloat16()):  # strided, empty, another dtype
        got = argmax_rows(scores)
        assert got.dtype == torch.int64 and got.tolist() == scores.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(2))
    out = call(Sampler(seed=0), logits, SamplingParams(temperature=temperature, top_k=1))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_and_random_rows_mix_in_one_batch():
    logits = torch.randn(32, 20, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.0)
              for i in range(32)]
    tokens = call(Sampler(seed=0), logits, params).token_ids
    argmax = logits.argmax(dim=-1).tolist()
    assert all(tokens[i] == argmax[i] for i in range(0, 32, 2))
    # With 16 random rows over 20 tokens, some row must leave the argmax.
    assert any(tokens[i] != argmax[i] for i in range(1, 32, 2))


def test_input_logits_are_not_modified():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4))
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.5, logprobs=3)
    call(Sampler(seed=0), logits, params, prompts=[[1, 2]] * 4, outputs=[[3, 3]] * 4)
    assert torch.equal(logits, before)


# --- the sampled distribution ---------------------------------------------------------------


def test_plain_sampling_matches_softmax():
    probs = [0.05, 0.1, 0.15, 0.2, 0.5]
    freqs = frequencies(logits_of(probs), SamplingParams(temperature=1.0))
    assert max_abs_diff(freqs, probs) < TOLERANCE


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_matches_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([0.0, 0.5, 1.0, 2.0, 2.5])
    expected = (logits / temperature).softmax(-1).tolist()
    freqs = frequencies(logits, SamplingParams(temperature=temperature))
    assert max_abs_diff(freqs, expected) < TOLERANCE


def test_temperature_orders_entropy():
    logits = torch.tensor([0.0, 0.5, 1.0, 2.0, 2.5, 0.3, 1.7, -1.0])
    entropies = [entropy(frequencies(logits, SamplingParams(temperature=t), draws=10_000))
                 for t in (0.25, 0.5, 1.0, 2.0, 4.0)]
    assert entropies == sorted(entropies)
    assert entropies[-1] - entropies[0] > 1.0


@pytest.mark.parametrize("k", [2, 3, 6])
def test_top_k_never_leaves_the_k_largest(k):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(5))
    freqs = frequencies(logits, SamplingParams(temperature=1.5, top_k=k))
    top = logits.topk(k).indices
    outside = torch.ones(12, dtype=torch.bool)
    outside[top] = False
    assert freqs[outside].sum() == 0
    expected = torch.zeros(12, dtype=torch.float64)
    expected[top] = (logits[top] / 1.5).double().softmax(-1)
    assert max_abs_diff(freqs, expected.tolist()) < TOLERANCE


def test_top_p_samples_the_renormalized_nucleus():
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    # Sorted: 0.4 + 0.3 = 0.7 < 0.8, adding 0.15 reaches 0.85: the nucleus is {1, 3, 4}.
    freqs = frequencies(logits_of(probs), SamplingParams(top_p=0.8))
    assert freqs[0] == 0 and freqs[2] == 0
    expected = [0.0, 0.4 / 0.85, 0.0, 0.3 / 0.85, 0.15 / 0.85]
    assert max_abs_diff(freqs, expected) < TOLERANCE


def test_top_p_keeps_the_top_token_even_when_it_alone_exceeds_p():
    freqs = frequencies(logits_of([0.9, 0.05, 0.05]), SamplingParams(top_p=0.01), draws=2000)
    assert freqs.tolist() == [1.0, 0.0, 0.0]


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    probs = [0.3, 0.25, 0.2, 0.15, 0.1]
    # After top-k=3: [0.4, 0.333, 0.267]; top-p=0.7 then keeps {0, 1} (0.733 >= 0.7). Applied to
    # the original distribution it would keep {0, 1, 2} (0.55 < 0.7).
    freqs = frequencies(logits_of(probs), SamplingParams(top_k=3, top_p=0.7))
    assert max_abs_diff(freqs, [0.3 / 0.55, 0.25 / 0.55, 0.0, 0.0, 0.0]) < TOLERANCE


def test_min_p_drops_tokens_below_the_scaled_maximum():
    probs = [0.06, 0.5, 0.15, 0.25, 0.04]
    # Threshold 0.2 * 0.5 = 0.1 keeps {1, 2, 3}.
    freqs = frequencies(logits_of(probs), SamplingParams(min_p=0.2))
    assert freqs[0] == 0 and freqs[4] == 0
    assert max_abs_diff(freqs, [0.0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9, 0.0]) < TOLERANCE


def test_min_p_uses_the_temperature_scaled_distribution():
    # At T=0.5 probabilities square (then renormalize): ratios to the top become
    # 0.09, 0.25, 0.0064 for 0.3, 0.5, 0.08; min_p = 0.1 keeps only the top two.
    probs = [1.0, 0.3, 0.5, 0.08]
    freqs = frequencies(logits_of(probs), SamplingParams(temperature=0.5, min_p=0.1))
    assert max_abs_diff(freqs, [1 / 1.25, 0.0, 0.25 / 1.25, 0.0]) < TOLERANCE


def test_sample_rows_draws_a_token_for_exactly_the_uniforms_in_its_interval():
    """Inverse transform on unnormalized weights: token t is drawn for u in [C(t-1), C(t)) / total.
    Token 1 weighs 2^-31, below a float32 sum's spacing after the first token's 0.5 (2^-25): it must
    still own its interval of the uniforms."""
    tiny = 2.0 ** -31
    weights = torch.tensor([[0.5, tiny, 0.5, 0.0]])  # exact in float32
    total = 1.0 + tiny
    start, end = 0.5 / total, (0.5 + tiny) / total  # token 1's interval

    def drawn(u):
        return sample_rows(weights, torch.tensor([[u]], dtype=torch.float64)).item()
    assert [drawn(u) for u in (0.0, start - 1e-12)] == [0, 0]
    assert drawn((start + end) / 2) == 1
    assert [drawn(u) for u in (end + 1e-12, 0.9)] == [2, 2]
    # The last token weighs 0: not even the largest uniform below 1 reaches it.
    assert drawn(math.nextafter(1.0, 0.0)) == 2


@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152])
def test_sample_rows_is_the_inverse_of_the_whole_rows_cumulative_sum(vocab):
    """The two-level search (blocks, then a token inside one) against numpy's float64 cumulative sum
    over the whole row, on rows with zeros, rare tokens and a vocabulary that is not a whole number of
    blocks."""
    generator = torch.Generator().manual_seed(vocab)
    weights = torch.rand(8, vocab, generator=generator) ** 8  # most tokens rare, a few common
    weights[:, ::3] = 0
    weights[1, : vocab // 2] = 0  # the weight sits in the row's second half
    weights[2] = 0
    weights[2, -1] = 1.0  # the last token alone
    u = torch.rand(8, 500, dtype=torch.float64, generator=generator)
    drawn = sample_rows(weights.repeat_interleave(500, 0), u.reshape(-1, 1)).view(8, 500)
    for row in range(8):
        cdf = np.cumsum(weights[row].double().numpy())
        expected = np.searchsorted(cdf, u[row].numpy() * cdf[-1], side="right")
        assert drawn[row].tolist() == expected.tolist()
    assert (weights.gather(1, drawn) > 0).all()


def test_sample_rows_matches_each_rows_weights():
    weights = torch.tensor([[2.0, 6.0, 0.0, 2.0], [0.0, 0.0, 5.0, 0.0]]).repeat(DRAWS, 1)
    u = torch.rand(2 * DRAWS, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tokens = sample_rows(weights, u).view(DRAWS, 2)
    first = torch.bincount(tokens[:, 0], minlength=4).double() / DRAWS
    assert max_abs_diff(first, [0.2, 0.6, 0.0, 0.2]) < TOLERANCE
    assert (tokens[:, 1] == 2).all()


def test_tokens_the_model_masked_are_never_sampled():
    logits = torch.tensor([1.0, float("-inf"), 0.5, float("-inf")])
    freqs = frequencies(logits, SamplingParams(temperature=3.0), draws=5000)
    assert freqs[1] == 0 and freqs[3] == 0


def reference_kept(logits_row, params):
    """Per-row, loop-by-loop oracle of the tokens top-k, then top-p, then min-p allow.

    Returns None when a top-p or min-p boundary sits within float error of a token.
    """
    probs = (logits_row.double() / params.temperature).softmax(-1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    kept = order[:params.top_k] if params.top_k > 0 else order
    mass = sum(probs[i].item() for i in kept)
    nucleus, cumulative = [], 0.0
    for i in kept:
        if cumulative >= params.top_p:
            break
        nucleus.append(i)
        cumulative += probs[i].item() / mass
        if abs(cumulative - params.top_p) < 1e-4:
            return None
    top = probs[nucleus[0]].item()
    if any(abs(probs[i].item() - params.min_p * top) < 1e-6 * top for i in nucleus):
        return None
    return {i for i in nucleus if probs[i].item() >= params.min_p * top}


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 40),
    temperature=st.floats(0.1, 3.0),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.05, 1.0),
    min_p=st.sampled_from([0.0, 0.01, 0.1, 0.5, 0.9]),
)
def test_filters_keep_exactly_the_reference_set(seed, vocab, temperature, top_k, top_p, min_p):
    logits = 2 * torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    assume(not params.is_greedy)
    expected = reference_kept(logits, params)
    assume(expected is not None)
    batch = logits.unsqueeze(0)
    processed = apply_temperature(batch, [params])
    processed = apply_min_p(apply_top_k_top_p(processed, [params]), [params])
    assert set(torch.isfinite(processed[0]).nonzero().flatten().tolist()) == expected
    tokens = call(Sampler(seed=seed), logits.expand(200, -1), params).token_ids
    assert set(tokens) <= expected


# --- penalties ------------------------------------------------------------------------------


def test_repetition_penalty_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]])
    params = [SamplingParams(repetition_penalty=2.0)]
    # Token 0 and 1 seen in the prompt, 2 and 3 in the output; 4 and 5 unseen.
    result = apply_penalties(logits, params, [[0, 1, 1]], [[2, 3, 2]])
    assert result.tolist() == [[1.0, -2.0, 0.25, -1.0, 3.0, 1.0]]


def test_repetition_penalty_lowers_a_seen_tokens_probability():
    logits = torch.tensor([[2.0, 1.9, -3.0]])
    sampler = Sampler(seed=0)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert call(sampler, logits, params).token_ids == [0]
    # 2.0 / 1.2 = 1.67 < 1.9: seeing token 0 in the prompt hands the argmax to token 1.
    assert call(sampler, logits, params, prompts=[[0]]).token_ids == [1]
    # Sampling follows the penalized distribution; the reported logprobs stay the model's.
    params = SamplingParams(temperature=1.0, repetition_penalty=1.5, logprobs=0)
    freqs_plain = frequencies(logits[0], SamplingParams(temperature=1.0))
    out = call(Sampler(seed=0), logits.expand(DRAWS, -1), params, prompts=[[0]] * DRAWS)
    freq_penalized = torch.tensor(out.token_ids).eq(0).double().mean().item()
    expected = torch.tensor([2.0 / 1.5, 1.9, -3.0]).softmax(-1)[0].item()
    assert abs(freq_penalized - expected) < TOLERANCE
    assert freq_penalized < freqs_plain[0].item() - 0.1
    raw = logits[0].log_softmax(-1)
    for token, entry in zip(out.token_ids[:50], out.logprobs[:50]):
        assert list(entry) == [token]
        assert math.isclose(entry[token].logprob, raw[token].item(), abs_tol=1e-6)


def test_presence_and_frequency_shift_output_tokens_only():
    logits = torch.zeros(1, 6)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)]
    result = apply_penalties(logits, params, [[0, 1]], [[3, 3, 3, 5]])
    # Token 3: 0.5 + 3 * 0.25; token 5: 0.5 + 0.25; prompt tokens 0 and 1 untouched.
    assert result.tolist() == [[0.0, 0.0, 0.0, -1.25, 0.0, -0.75]]


def test_negative_presence_and_frequency_encourage_repeats():
    result = apply_penalties(torch.zeros(1, 4), [SamplingParams(presence_penalty=-1.0,
                                                                 frequency_penalty=-0.5)],
                             [[]], [[2, 2]])
    assert result.tolist() == [[0.0, 0.0, 2.0, 0.0]]


def test_penalties_apply_per_row():
    logits = torch.ones(3, 5)
    params = [SamplingParams(), SamplingParams(repetition_penalty=2.0),
              SamplingParams(frequency_penalty=1.0)]
    outputs = [[1], [1, 1], [4, 4]]
    result = apply_penalties(logits, params, [[0], [0], [0]], outputs)
    assert result.tolist() == [
        [1.0, 1.0, 1.0, 1.0, 1.0],  # no penalty: seen tokens untouched
        [0.5, 0.5, 1.0, 1.0, 1.0],  # repetition: prompt and output tokens
        [1.0, 1.0, 1.0, 1.0, -1.0],  # frequency: output count only
    ]


def test_no_penalty_returns_logits_unchanged():
    logits = torch.randn(2, 7)
    assert apply_penalties(logits, [SamplingParams()] * 2, [[1], [2]], [[3], [4]]) is logits


# --- seeds -----------------------------------------------------------------------------------


def generate(sampler, logits_per_step, batches):
    """Runs steps, batches[s] listing (request_id, params) rows; returns each request's tokens."""
    produced: dict[str, list[int]] = {}
    for step, rows in enumerate(batches):
        for request_id, params in rows:
            if request_id not in produced:
                produced[request_id] = []
                sampler.add_request(request_id, params)
        logits = torch.stack([logits_per_step[(request_id, step)] for request_id, _ in rows])
        out = sampler(logits, [r for r, _ in rows], [p for _, p in rows],
                      [[1, 2, 3] for _ in rows], [produced[r] for r, _ in rows])
        for (request_id, _), token in zip(rows, out.token_ids):
            produced[request_id].append(token)
    return produced


class Logits(dict):
    """Deterministic logits per (request, step), the same in every run."""

    def __missing__(self, key):
        request_id, step = key
        seed = sum(map(ord, request_id)) * 1000 + step
        self[key] = torch.randn(40, generator=torch.Generator().manual_seed(seed))
        return self[key]


SEEDED = SamplingParams(temperature=1.0, seed=1234, presence_penalty=0.3, top_p=0.95)


def test_same_seed_same_tokens_whatever_the_batch():
    steps = 12
    alone = generate(Sampler(seed=1), Logits(), [[("a", SEEDED)]] * steps)["a"]
    crowded = []
    for step in range(steps):
        others = [(f"x{step}-{i}", SamplingParams(temperature=1.0)) for i in range(step % 4)]
        others.append(("b", SamplingParams(temperature=0.8, seed=99)))
        position = step % (len(others) + 1)
        crowded.append(others[:position] + [("a", SEEDED)] + others[position:])
    with_others = generate(Sampler(seed=2), Logits(), crowded)["a"]
    assert with_others == alone
    assert len(set(alone)) > 3  # the generator advances: not one repeated draw


def test_different_seeds_give_different_tokens():
    steps = 20
    other = SamplingParams(temperature=1.0, seed=4321, presence_penalty=0.3, top_p=0.95)
    a = generate(Sampler(seed=0), Logits(), [[("a", SEEDED)]] * steps)["a"]
    b = generate(Sampler(seed=0), Logits(), [[("a", other)]] * steps)["a"]
    assert a != b


def test_re_adding_a_request_restarts_its_generator():
    sampler = Sampler()
    first = generate(sampler, Logits(), [[("a", SEEDED)]] * 6)["a"]
    sampler.remove_request("a")
    again = generate(sampler, Logits(), [[("a", SEEDED)]] * 6)["a"]
    assert again == first


def test_engine_seed_makes_unseeded_requests_reproducible():
    params = SamplingParams(temperature=1.0)
    batches = [[(f"r{i}", params) for i in range(8)]] * 5
    one = generate(Sampler(seed=7), Logits(), batches)
    two = generate(Sampler(seed=7), Logits(), batches)
    three = generate(Sampler(seed=8), Logits(), batches)
    assert one == two
    assert one != three


def test_seeded_request_must_be_added_first():
    sampler = Sampler()
    with pytest.raises(KeyError, match="add_request"):
        sampler(torch.zeros(1, 5), ["ghost"], [SamplingParams(seed=3)], [[]], [[]])


def test_batch_sizes_must_agree():
    with pytest.raises(ValueError, match="request_ids"):
        Sampler()(torch.zeros(2, 5), ["a"], [SamplingParams()] * 2, [[]] * 2, [[]] * 2)


# --- logprobs --------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution_and_include_the_sampled_token():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(6))
    # Penalties and filters change what is sampled, never the reported logprobs.
    params = [SamplingParams(temperature=0.7, top_k=3, logprobs=k, repetition_penalty=1.3)
              for k in (0, 1, 2, 5, 30, 0)]
    params[-1] = SamplingParams(temperature=0.7)  # this row did not ask
    out = call(Sampler(seed=0), logits, params, prompts=[[0, 1, 2]] * 6)
    reference = logits.double().log_softmax(-1)
    for row, (token, entry, p) in enumerate(zip(out.token_ids, out.logprobs, params)):
        if p.logprobs is None:
            assert entry is None
            continue
        top = reference[row].topk(p.logprobs).indices.tolist()
        assert set(entry) == set(top) | {token}
        assert list(entry)[0] == token
        for token_id, value in entry.items():
            assert math.isclose(value.logprob, reference[row, token_id].item(), abs_tol=1e-5)
            # vLLM's rank: 1-based, in the whole raw distribution (no ties in random logits).
            assert value.rank == 1 + (reference[row] > reference[row, token_id]).sum().item()
            assert value.decoded_token is None  # the sampler has no tokenizer; the engine fills it in


def test_logprobs_in_low_precision_are_computed_in_float32():
    logits = (torch.randn(2, 50, generator=torch.Generator().manual_seed(8)) * 4).to(torch.bfloat16)
    out = call(Sampler(seed=0), logits, SamplingParams(temperature=0.0, logprobs=2))
    reference = logits.float().log_softmax(-1)
    for row, entry in enumerate(out.logprobs):
        for token_id, value in entry.items():
            assert math.isclose(value.logprob, reference[row, token_id].item(), abs_tol=1e-6)
