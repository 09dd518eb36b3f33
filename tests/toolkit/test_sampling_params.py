import pytest

from toolkit.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, SamplingType, child_seed


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output


@pytest.mark.parametrize("field, value, expected_message", [
    ("n", 0, "n must be"),
    ("n", 1.5, "n must be"),
    ("temperature", -1.0, "temperature must be >= 0, got -1.0"),
    ("temperature", "hot", "temperature must be"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_k", -2, "top_k must be"),
    ("top_k", 2.0, "top_k must be"),
    ("top_k", True, "top_k must be"),
    ("min_p", -0.1, "min_p must be in [0, 1]"),
    ("min_p", 1.1, "min_p must be in [0, 1]"),
    ("seed", 1.5, "seed must be"),
    ("seed", 2**64, "seed must be None or an int in [-9223372036854775808, 18446744073709551615]"),
    ("seed", -(2**63) - 1, "seed must be"),
    ("max_tokens", 0, "max_tokens must be"),
    ("min_tokens", -1, "min_tokens must be"),
    ("logprobs", -1, "logprobs must be"),
    ("prompt_logprobs", -1, "prompt_logprobs must be None or an int >= 0"),
    ("prompt_logprobs", 1.5, "prompt_logprobs must be"),
    ("prompt_logprobs", True, "prompt_logprobs must be"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("repetition_penalty", -1.0, "repetition_penalty must be > 0"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("presence_penalty", -2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", 2.1, "frequency_penalty must be in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
    ("stop", "", "stop must"),
    ("stop", ["ok", 3], "stop must"),
    ("stop_token_ids", [-1], "stop_token_ids must"),
    ("stop_token_ids", ["a"], "stop_token_ids must"),
])
def test_invalid_value_names_field_and_range(field, value, expected_message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert expected_message in str(info.value)
    assert field in str(info.value)


def test_min_tokens_may_not_exceed_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)
    # With max_tokens unresolved (None) the engine checks against max_model_len instead.
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-6), dict(top_k=-1), dict(top_k=1),
    dict(min_p=0.0), dict(min_p=1.0), dict(seed=0), dict(seed=-5), dict(max_tokens=None),
    dict(logprobs=0), dict(prompt_logprobs=0), dict(prompt_logprobs=5), dict(presence_penalty=-2.0),
    dict(frequency_penalty=2.0),
    dict(repetition_penalty=0.5),
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_stop_normalizes_to_lists():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(stop=["ab", "xyz"]).max_stop_str_len == 3
    assert SamplingParams().max_stop_str_len == 0


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0


def test_sampling_type():
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert SamplingParams(temperature=0, seed=3).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy
    # A near-zero temperature would overflow logits / T to inf: it is greedy too.
    assert SamplingParams(temperature=1e-7).is_greedy


def test_fields_changed_after_construction_are_checked_again():
    sp = SamplingParams()
    sp.n = 0
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        sp.validate()


def test_child_seeds_stay_in_the_seed_range():
    assert child_seed(7, 2) == 9
    assert child_seed(SEED_MAX, 1) == SEED_MIN
    SamplingParams(seed=child_seed(SEED_MAX, 3))


@pytest.mark.parametrize("kwargs,message", [
    (dict(stop=5), "stop must be a string or a list of strings, got int 5"),
    (dict(stop_token_ids="a"), "stop_token_ids must be a list of ints, got str 'a'"),
    (dict(temperature="0.5"), "temperature must be a number, got str '0.5'"),
    (dict(top_p=None), "top_p must be a number, got NoneType"),
    (dict(max_tokens=5.5), "max_tokens must be None or an int >= 1, got 5.5"),
])
def test_wrong_types_name_the_field_and_the_type(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


def test_whole_float_counts_are_taken_as_ints_as_openai_does():
    sp = SamplingParams(max_tokens=5.0, n=2.0)
    assert (sp.max_tokens, sp.n) == (5, 2) and type(sp.max_tokens) is int
