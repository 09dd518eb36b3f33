"""Batched sampling of one token per row of a logits batch.

Order of operations (vLLM's): allowed_token_ids and logit_bias -> penalties -> greedy rows take the
argmax -> temperature -> top-k -> top-p -> min-p -> sample. All per-row settings become [B, 1] tensors
once per call, so every step is a handful of batched tensor ops whatever the mix of requests; the only
host syncs are reading back the sampled ids (and the logprobs, when asked for).

Sampling is by inverse transform (`sample_rows`): token i is the first whose cumulative probability
exceeds a uniform u, which picks it with probability probs[i]. Its randomness is one float64 uniform
per request and output position, not a noise value per vocabulary entry (the exponential race,
argmax(probs / E), draws as many random numbers as the vocabulary has tokens, which cost more than the
rest of a decode step's sampling together); a seeded request's uniform is drawn from a generator keyed
by (seed, position), so it gets the same tokens whatever else shares the batch and whether or not
speculative decoding verified that position (speculative/rejection.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from toolkit.outputs import Logprob
from toolkit.sampling_params import SamplingParams, SamplingType


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: Logprob} for the top `params.logprobs` tokens plus the sampled one (no
    # decoded text: the engine holds the tokenizer), or None when the request did not ask for logprobs.
    logprobs: list[dict[int, Logprob] | None]


class Sampler:
    def __init__(self, seed: int | None = None):
        self.seed = seed
        # Generators live on the device of the tensors they fill, which is only known from the
        # logits, so they are created on first use.
        self._engine_generators: dict[torch.device, torch.Generator] = {}
        self._request_seeds: dict[str, int] = {}

    def add_request(self, request_id: str, params: SamplingParams) -> None:
        """Registers a request; a seeded one draws its randomness from its seed (see `random_rows`)."""
        if params.seed is not None:
            self._request_seeds[request_id] = params.seed

    def remove_request(self, request_id: str) -> None:
        self._request_seeds.pop(request_id, None)

    def __call__(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
    ) -> SamplerOutput:
        """One token per row. Row i samples output position len(output_token_ids[i]) of its request."""
        # Every op below is out of place, so when the input already is float32 (and .to() returns
        # it as is) the caller's logits are left untouched and double as the raw distribution.
        raw_logits = logits if logits.dtype == torch.float32 else logits.to(torch.float32)
        tokens = self.sample(raw_logits, request_ids, params, prompt_token_ids, output_token_ids)
        return SamplerOutput(
            token_ids=tokens.tolist(),
            logprobs=gather_logprobs(raw_logits, tokens, params),
        )

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
               prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
               positions: list[int] | None = None) -> torch.Tensor:
        """The sampled ids as an int64 tensor [B] (no logprobs). `positions`: each row's output position
        (default len(output_token_ids[i])), for callers whose output lists are only read by penalties."""
        _check_batch(logits, request_ids, params, prompt_token_ids, output_token_ids)
        logits = logits if logits.dtype == torch.float32 else logits.to(torch.float32)
        processed = apply_penalties(apply_logits_processors(logits, params), params, prompt_token_ids,
                                    output_token_ids)
        positions = [len(out) for out in output_token_ids] if positions is None else positions
        return self._sample(processed, request_ids, params, positions)

    def probabilities(self, logits: torch.Tensor, params: list[SamplingParams], prompt_token_ids: list[list[int]],
                      output_token_ids: list[list[int]]) -> torch.Tensor:
        """[B, V] float32: the distribution each row samples from, after allowed_token_ids, logit_bias,
        penalties, temperature,
        top-k, top-p and min-p (a greedy row's is its temperature-1 distribution; it takes the argmax)."""
        logits = logits if logits.dtype == torch.float32 else logits.to(torch.float32)
        logits = apply_penalties(apply_logits_processors(logits, params), params, prompt_token_ids, output_token_ids)
        return self._filtered(logits, params).softmax(dim=-1)

    @staticmethod
    def _filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        return apply_min_p(apply_top_k_top_p(apply_temperature(logits, params), params), params)

    def _sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
                positions: list[int]) -> torch.Tensor:
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return argmax_rows(logits)
        probs = self._filtered(logits, params).softmax(dim=-1)
        random_tokens = sample_rows(probs, self.random_rows(request_ids, params, positions, STREAM_SAMPLE, probs.device))
        if not any(greedy):
            return random_tokens
        is_greedy = torch.tensor(greedy, device=logits.device)
        return torch.where(is_greedy, argmax_rows(logits), random_tokens)

    def random_rows(self, request_ids: list[str], params: list[SamplingParams], positions: list[int], stream: int,
                    device: torch.device) -> torch.Tensor:
        """One float64 uniform on [0, 1) per row, [B, 1] (53 random bits: a float32 uniform's 24 would
        round each token's chance in `sample_rows` to a multiple of 2^-24). A seeded request's is a
        function of (seed, output position, stream) alone, so it is the same whatever else shares the
        batch, however its tokens were split over steps, and whether or not a speculative step computed
        that position; other rows use the engine's stream."""
        out = torch.zeros(len(request_ids), 1, dtype=torch.float64, device=device)  # greedy rows: never read
        types = [p.sampling_type for p in params]
        if SamplingType.RANDOM in types:
            out.uniform_(generator=self._engine_generator(device))
        for row, (request_id, kind) in enumerate(zip(request_ids, types)):
            if kind == SamplingType.RANDOM_SEED:
                out[row].uniform_(generator=self._keyed_generator(request_id, positions[row], stream, device))
        return out

    def _engine_generator(self, device: torch.device) -> torch.Generator:
        generator = self._engine_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()  # non-deterministic, like an unseeded torch program
            else:
                generator.manual_seed(self.seed)
            self._engine_generators[device] = generator
        return generator

    def _keyed_generator(self, request_id: str, position: int, stream: int, device: torch.device) -> torch.Generator:
        if request_id not in self._request_seeds:
            raise KeyError(f"request {request_id!r} has a seed but was not given to Sampler.add_request")
        generator = torch.Generator(device=device)
        generator.manual_seed(_mix(self._request_seeds[request_id], position, stream))
        return generator


# The independent random streams of one output position: the plain sample (also a speculative step's
# bonus and n-gram verification), a draft model's own sample, the acceptance test, the residual sample.
STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = range(4)


def _mix(seed: int, position: int, stream: int) -> int:
    """A 63-bit generator seed from (seed, position, stream): splitmix64's finalizer over each part in
    turn, so nearby keys give unrelated streams."""
    x = 0
    for part in (seed, position, stream):
        x = (x ^ (part & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x >> 1


SAMPLE_BLOCK = 256  # tokens per block of `sample_rows`' first, coarse search


def sample_rows(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's token drawn with probability weights[i, t] / weights[i].sum(), as int64 [B], by inverse
    transform: the first token whose cumulative weight exceeds u[i] times the row's total (u: [B, 1],
    float64, uniform on [0, 1)). The weights need not be normalized (a rejection's residual is not); a
    token of weight 0 is never drawn. Sums are float64, so each token's chance is exact to ~1e-16 of the
    total even over a vocabulary-sized row, where float32 sums would round a rare token's share to the
    running total's spacing. In two levels, since a float64 cumulative sum over the whole row is
    several times slower than summing it: find the block of SAMPLE_BLOCK tokens from the blocks'
    sums, then the token inside it."""
    rows, vocab = weights.shape
    # One float64 copy, padded with zero weights to whole blocks: the blocks' sums and the chosen
    # block's running sum both read it.
    wide = weights.new_zeros(rows, -(-vocab // SAMPLE_BLOCK) * SAMPLE_BLOCK, dtype=torch.float64)
    wide[:, :vocab] = weights
    block_cdf = wide.view(rows, -1, SAMPLE_BLOCK).sum(-1).cumsum(dim=1)
    # u < 1, so the target stays below the total: the first block whose cumulative sum exceeds it
    # holds weight. (The clamps keep a row of no weight at all, or of NaN, in range.)
    target = u * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), 0.0)
    cdf = wide.gather(1, block * SAMPLE_BLOCK + torch.arange(SAMPLE_BLOCK, device=weights.device)).cumsum(dim=1)
    # The block's own running sum may round apart from its sum above: keep the rest inside its weight.
    rest = torch.minimum((target - before).clamp_(min=0), torch.nextafter(cdf[:, -1:], torch.zeros_like(target)))
    token = torch.searchsorted(cdf, rest, right=True).clamp_(max=SAMPLE_BLOCK - 1)
    return (block * SAMPLE_BLOCK + token).squeeze(1).clamp_(max=vocab - 1)


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """Each row's argmax as int64 [B]: the first maximum, a NaN counting as the maximum (torch's and
    numpy's rule alike). On CPU through numpy, whose argmax is vectorized where torch 2.13's CPU
    argmax over vocabulary-sized rows is not (docs/benchmarks.md)."""
    if scores.device.type == "cpu" and scores.dtype == torch.float32:
        return torch.from_numpy(scores.numpy().argmax(axis=1))
    return scores.argmax(dim=-1)


def _check_batch(logits, request_ids, params, prompt_token_ids, output_token_ids) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    sizes = {len(request_ids), len(params), len(prompt_token_ids), len(output_token_ids)}
    if sizes != {logits.shape[0]}:
        raise ValueError(
            f"batch of {logits.shape[0]} logits rows needs as many request_ids "
            f"({len(request_ids)}), params ({len(params)}), prompt_token_ids "
            f"({len(prompt_token_ids)}) and output_token_ids ({len(output_token_ids)})")


def _row_tensor(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A per-row setting as a [B, 1] column that broadcasts over the vocab."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _token_counts(token_lists: list[list[int]], vocab_size: int,
                  like: torch.Tensor) -> torch.Tensor:
    """[B, V] count of each token id in each row's list, built with one scatter-add."""
    counts = torch.zeros(len(token_lists), vocab_size, dtype=like.dtype, device=like.device)
    lengths = torch.tensor([len(tokens) for tokens in token_lists])
    if int(lengths.sum()) == 0:
        return counts
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    cols = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    ones = torch.ones(len(cols), dtype=like.dtype, device=like.device)
    counts.index_put_((rows.to(like.device), cols.to(like.device)), ones, accumulate=True)
    return counts


def uses_penalties(params: SamplingParams) -> bool:
    """Whether the request's distribution depends on the tokens it has produced so far."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def uses_logits_processors(params: SamplingParams) -> bool:
    return bool(params.allowed_token_ids or params.logit_bias)


def apply_logits_processors(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """vLLM's allowed_token_ids (every other token to -inf) and logit_bias (added), on the raw logits."""
    rows = [i for i, p in enumerate(params) if uses_logits_processors(p)]
    if not rows:
        return logits
    # Built on the host for the rows that ask only, then added in one out-of-place op.
    add = torch.zeros(len(rows), logits.shape[1], dtype=logits.dtype)
    for j, i in enumerate(rows):
        allowed, bias = params[i].allowed_token_ids, params[i].logit_bias
        if allowed:
            add[j] = float("-inf")
            add[j, allowed] = 0.0
        if bias:
            add[j, list(bias)] += torch.tensor(list(bias.values()), dtype=logits.dtype)
    return logits.index_add(0, torch.tensor(rows, device=logits.device), add.to(logits.device))


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]]) -> torch.Tensor:
    """Repetition (HF/vLLM: prompt and output tokens), presence and frequency (OpenAI: output)."""
    uses_repetition = [p.repetition_penalty != 1.0 for p in params]
    uses_additive = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
    if not any(uses_repetition) and not any(uses_additive):
        return logits
    # Rows without a penalty contribute no tokens, so the counting work follows only the rows
    # that need it; their all-zero counts leave their logits unchanged.
    output_counts = _token_counts(
        [out if rep or add else [] for out, rep, add in
         zip(output_token_ids, uses_repetition, uses_additive)], logits.shape[1], logits)
    if any(uses_repetition):
        prompt_counts = _token_counts(
            [prompt if rep else [] for prompt, rep in zip(prompt_token_ids, uses_repetition)],
            logits.shape[1], logits)
        seen = (prompt_counts + output_counts) > 0
        penalty = _row_tensor([p.repetition_penalty for p in params], logits)
        # Dividing a positive logit and multiplying a negative one both lower the token's odds.
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if any(uses_additive):
        frequency = _row_tensor([p.frequency_penalty for p in params], logits)
        presence = _row_tensor([p.presence_penalty for p in params], logits)
        logits = logits - frequency * output_counts - presence * (output_counts > 0)
    return logits


def apply_temperature(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # Greedy rows divide by 1: their result comes from the argmax, and 0 would make NaNs.
    temperature = _row_tensor([1.0 if p.is_greedy else p.temperature for p in params], logits)
    return logits / temperature


def apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Masks to -inf the tokens outside each row's top-k, then outside the top-p nucleus."""
    vocab_size = logits.shape[1]
    # top_k >= vocab keeps everything; treating it as disabled spares the sort.
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    use_top_k = any(k < vocab_size for k in top_k)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if not use_top_k and not use_top_p:
        return logits
    sorted_logits, order = logits.sort(dim=-1)  # ascending: the tail to cut comes first
    if use_top_k:
        kth_position = vocab_size - torch.tensor(top_k, device=logits.device).unsqueeze(1)
        kth_largest = sorted_logits.gather(1, kth_position)
        # Values tied with the k-th largest survive, as in HF and vLLM.
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if use_top_p:
        top_p = _row_tensor([p.top_p for p in params], logits)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail while its total mass stays <= 1 - top_p: what remains is the smallest
        # set of most likely tokens holding at least top_p. The most likely token always stays.
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Masks tokens whose probability is below min_p times the most likely token's."""
    if not any(p.min_p > 0 for p in params):
        return logits
    min_p = _row_tensor([p.min_p for p in params], logits)
    # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p): no softmax needed, and the
    # ratio is the same before and after top-k/top-p renormalize. min_p = 0 gives log 0 = -inf,
    # which masks nothing.
    threshold = logits.max(dim=-1, keepdim=True).values + min_p.log()
    return logits.masked_fill(logits < threshold, float("-inf"))


def gather_logprobs(raw_logits: torch.Tensor, tokens: torch.Tensor,
                    params: list[SamplingParams]) -> list[dict[int, Logprob] | None]:
    """Raw model logprobs (no penalty or filter): the sampled token's plus each row's top ones."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[dict[int, Logprob] | None] = [None] * len(params)
    if not rows:
        return result
    row_index = torch.tensor(rows, device=raw_logits.device)
    entries = logprob_entries(raw_logits.index_select(0, row_index), tokens.index_select(0, row_index),
                              [params[i].logprobs for i in rows])
    for i, entry in zip(rows, entries):
        result[i] = entry
    return result


def logprob_entries(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[dict[int, Logprob]]:
    """Per row of float32 `logits` [R, V]: {token: Logprob} for tokens[r] and the row's top ks[r], with
    vLLM's ranks (top-k: 1..k; the chosen token: how many tokens are at least as likely)."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = tokens.unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(min(max(ks), logprobs.shape[1]), dim=-1)
    # Whole tensors come back at once: no host round trip per value.
    chosen, chosen_logprobs, ranks, top_logprobs, top_ids = (
        t.tolist() for t in (tokens, chosen_logprobs, ranks, top_logprobs, top_ids))
    out = []
    for j, k in enumerate(ks):
        # The top-k go in after the chosen token, so a chosen token among them keeps its top-k rank.
        entry = {chosen[j]: Logprob(chosen_logprobs[j][0], ranks[j])}
        entry.update((t, Logprob(v, r)) for r, (t, v) in enumerate(zip(top_ids[j][:k], top_logprobs[j][:k]), 1))
        out.append(entry)
    return out
