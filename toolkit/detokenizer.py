"""Incremental detokenization and stop-string checks for one generated sequence.

Text is produced by `tokenizers.decoders.DecodeStream`, which holds back bytes until they form
whole UTF-8 characters, so a character split over byte-level tokens appears once, complete,
never as U+FFFD.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from toolkit.sampling_params import SamplingParams

# DecodeStream decodes the primed prompt tokens together with each new token and keeps what comes
# after the prompt's text. A few prompt tokens are enough for the decoder to see the right context
# (a SentencePiece-style leading "▁" becomes a space only after other text); more cost time.
_MIN_PRIME_TOKENS = 4
_MAX_PRIME_TOKENS = 24

# The message tokenizers raises when a tokenizer's decodings are not prefix-monotonic
# (seen with some real tokenizers); vLLM recovers the same way, by restarting the stream.
_INVALID_PREFIX_ERROR = "Invalid prefix encountered"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        """`tokenizer` is a transformers fast tokenizer, or None for token-id-only use."""
        self.output_text = ""
        self.num_output_tokens = 0
        self._stop = list(params.stop) if tokenizer is not None else []
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._skip_special_tokens = params.skip_special_tokens
        self._backend = tokenizer.backend_tokenizer if tokenizer is not None else None
        self._stream = None
        if self._backend is not None:
            self._stream = DecodeStream(
                ids=self._prompt_suffix(prompt_token_ids),
                skip_special_tokens=self._skip_special_tokens)

    def _prompt_suffix(self, prompt_token_ids: list[int]) -> list[int]:
        """The shortest prompt tail (of at least a few tokens) that decodes cleanly.

        A tail cut through a multi-byte character decodes with U+FFFD at its start; priming with
        that would make the stream's prefix text unreliable. Fall back to the whole prompt.
        """
        if len(prompt_token_ids) <= _MIN_PRIME_TOKENS:
            return list(prompt_token_ids)
        for length in range(_MIN_PRIME_TOKENS, min(len(prompt_token_ids), _MAX_PRIME_TOKENS) + 1):
            suffix = prompt_token_ids[-length:]
            text = self._backend.decode(suffix, skip_special_tokens=self._skip_special_tokens)
            if "\ufffd" not in text:
                return suffix
        return list(prompt_token_ids)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Appends generated tokens; returns the stop string they completed, if any.

        On a match, output_text is cut before the stop string (or after it, when
        params.include_stop_str_in_output), at its earliest occurrence in the new text.
        Like stop tokens, stop strings do not count until more than min_tokens tokens exist.
        """
        self.num_output_tokens += len(token_ids)
        if self._stream is None:
            return None
        previous_length = len(self.output_text)
        for token_id in token_ids:
            chunk = self._step(token_id)
            if chunk:
                self.output_text += chunk
        if (len(self.output_text) == previous_length or not self._stop
                or self.num_output_tokens <= self._min_tokens):
            return None
        return self._check_stop(previous_length)

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as error:
            if not str(error).startswith(_INVALID_PREFIX_ERROR):
                raise
            # The stream's state is broken; restart it from this token. At worst a leading
            # space of this one token is lost, instead of the whole request failing.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._backend, token_id)

    def _check_stop(self, previous_length: int) -> str | None:
        best_index, best_stop = -1, None
        for stop in self._stop:
            # Only a match ending in the new text is new, so it starts at most len(stop) - 1
            # characters before it: the search never rescans the whole output.
            start = max(0, previous_length - len(stop) + 1)
            index = self.output_text.find(stop, start)
            if index != -1 and (best_stop is None or index < best_index):
                best_index, best_stop = index, stop
        if best_stop is None:
            return None
        end = best_index + len(best_stop) if self._include_stop else best_index
        self.output_text = self.output_text[:end]
        return best_stop
