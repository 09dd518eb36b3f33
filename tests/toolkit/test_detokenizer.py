"""Incremental detokenization against the tokenizer's own full decode, on tokenizers trained here.

Two small BPE tokenizers are trained offline: a byte-level one (GPT-2 style, where a character
outside the learned merges spans several byte tokens) and a Metaspace one (SentencePiece style,
where a word's leading space is only a space after other text).
"""

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.hypothesis_profiles import examples
from toolkit.detokenizer import IncrementalDetokenizer
from toolkit.sampling_params import SamplingParams

CORPUS = [
    "the cat sat on the mat",
    "a dog ran in the park and the cat watched",
    "héllo wörld, ça va? naïve café",
    "日本語のテキスト",
    "hello world hello world the end",
]
# Characters the tests write: ASCII, 2-, 3- and 4-byte UTF-8, most never merged into one token.
ALPHABET = "abcdehlmorst ,.?éöçï日本語テキ😀🙂€"


@pytest.fixture(scope="module")
def byte_level():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@pytest.fixture(scope="module")
def metaspace():
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "</s>"])
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>")


def expected_output_text(tokenizer, prompt_ids, output_ids, skip_special_tokens=True):
    """What the output adds to the full decode: the oracle for incremental text."""
    full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=skip_special_tokens)
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    assert full.startswith(prompt)
    return full[len(prompt):]


def split_encoding(tokenizer, prompt_text, output_text):
    ids = tokenizer.encode(prompt_text + output_text)
    prompt_len = len(tokenizer.encode(prompt_text))
    assert ids[:prompt_len] == tokenizer.encode(prompt_text)
    return ids[:prompt_len], ids[prompt_len:]


def test_token_by_token_text_equals_full_decode(byte_level):
    prompt, output = split_encoding(byte_level, "hello world", " 日本語 🙂 naïve 😀€ end")
    # The test needs tokens holding only part of a character.
    assert any("\ufffd" in byte_level.decode([t]) for t in output)
    detok = IncrementalDetokenizer(byte_level, prompt, SamplingParams())
    seen = []
    for token in output:
        assert detok.add_tokens([token]) is None
        # Never half a character: held-back bytes show up only once their character is whole.
        assert "\ufffd" not in detok.output_text
        seen.append(detok.output_text)
    assert detok.output_text == byte_level.decode(output) == " 日本語 🙂 naïve 😀€ end"
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:]))


def test_a_character_split_over_byte_tokens_appears_whole(byte_level):
    emoji = byte_level.encode("🙂")
    assert len(emoji) > 1  # the test needs the character split over several tokens
    detok = IncrementalDetokenizer(byte_level, byte_level.encode("hello"), SamplingParams())
    for token in emoji[:-1]:
        detok.add_tokens([token])
        assert detok.output_text == ""
    detok.add_tokens(emoji[-1:])
    assert detok.output_text == "🙂"


@settings(max_examples=examples(80), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=ALPHABET, min_size=1, max_size=40), data=st.data())
def test_any_text_and_chunking_round_trips(byte_level, text, data):
    ids = byte_level.encode(text)
    cut = data.draw(st.integers(0, len(ids)), label="prompt length")
    prompt, output = ids[:cut], ids[cut:]
    # A prompt cut inside a character has no well-defined text of its own.
    assume("\ufffd" not in byte_level.decode(prompt))
    detok = IncrementalDetokenizer(byte_level, prompt, SamplingParams())
    position = 0
    while position < len(output):
        size = data.draw(st.integers(1, 4), label="chunk")
        detok.add_tokens(output[position:position + size])
        position += size
    assert detok.output_text == expected_output_text(byte_level, prompt, output)


def test_leading_space_is_kept_thanks_to_the_prompt(metaspace):
    prompt, output = split_encoding(metaspace, "the cat sat", " on the mat")
    detok = IncrementalDetokenizer(metaspace, prompt, SamplingParams())
    for token in output:
        detok.add_tokens([token])
    assert detok.output_text == expected_output_text(metaspace, prompt, output) == " on the mat"
    # Decoding the output alone would lose that space: the prompt context is what keeps it.
    assert metaspace.decode(output) == "on the mat"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(byte_level, skip):
    prompt = byte_level.encode("the cat")
    output = byte_level.encode(" sat") + [byte_level.eos_token_id] + byte_level.encode(" on")
    detok = IncrementalDetokenizer(byte_level, prompt, SamplingParams(skip_special_tokens=skip))
    detok.add_tokens(output)
    assert detok.output_text == expected_output_text(byte_level, prompt, output, skip)
    assert ("<eos>" in detok.output_text) == (not skip)


# --- stop strings ---------------------------------------------------------------------------


def feed_until_stop(detok, tokens):
    """Adds tokens one at a time; returns (stop string, how many tokens it took)."""
    for count, token in enumerate(tokens, start=1):
        stop = detok.add_tokens([token])
        if stop is not None:
            return stop, count
    return None, len(tokens)


@pytest.mark.parametrize("include, expected_text", [(False, " the ca"), (True, " the cat s")])
def test_stop_string_spanning_two_tokens(byte_level, include, expected_text):
    prompt, output = split_encoding(byte_level, "hello", " the cat sat on the mat")
    pieces = [byte_level.decode([t]) for t in output]
    assert pieces[:3] == [" the", " cat", " sat"]
    assert not any("t s" in piece for piece in pieces)  # it only exists across two tokens
    params = SamplingParams(stop=["t s"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(byte_level, prompt, params)
    assert feed_until_stop(detok, output) == ("t s", 3)
    assert detok.output_text == expected_text


def test_stop_string_made_of_byte_tokens(byte_level):
    prompt = byte_level.encode("hello")
    output = byte_level.encode(" ok 🙂 more")
    detok = IncrementalDetokenizer(byte_level, prompt, SamplingParams(stop="🙂"))
    stop, count = feed_until_stop(detok, output)
    assert stop == "🙂"
    assert byte_level.decode(output[:count]) == " ok 🙂"  # found with its last byte, not later
    assert detok.output_text == " ok "


def test_earliest_stop_wins_within_one_batch_of_tokens(byte_level):
    prompt, output = split_encoding(byte_level, "hello", " the cat sat on the mat")
    detok = IncrementalDetokenizer(byte_level, prompt, SamplingParams(stop=["mat", "sat", "on"]))
    # Several tokens at once, as speculative decoding delivers them.
    assert detok.add_tokens(output) == "sat"
    assert detok.output_text == " the cat "


def test_stop_strings_wait_for_min_tokens(byte_level):
    prompt, output = split_encoding(byte_level, "hello", " the cat sat on the mat")
    params = SamplingParams(stop="the", min_tokens=2)
    detok = IncrementalDetokenizer(byte_level, prompt, params)
    # " the" is the first token: within min_tokens, so it does not stop the request, and the
    # search does not go back for it later. The second "the" does.
    stop, count = feed_until_stop(detok, output)
    assert (stop, count) == ("the", 5)
    assert detok.output_text == " the cat sat on "


def test_no_stop_no_truncation(byte_level):
    prompt, output = split_encoding(byte_level, "hello", " the cat sat")
    detok = IncrementalDetokenizer(byte_level, prompt, SamplingParams(stop=["dog", "x"]))
    assert feed_until_stop(detok, output) == (None, len(output))
    assert detok.output_text == " the cat sat"


def test_without_a_tokenizer_text_stays_empty():
    detok = IncrementalDetokenizer(None, [1, 2, 3], SamplingParams(stop="a"))
    assert detok.add_tokens([4, 5]) is None
    assert detok.output_text == ""
    assert detok.num_output_tokens == 2
