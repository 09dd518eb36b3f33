"""OpenAI response bodies out: whole (`text_completion`, `chat.completion`) or streamed chunk by chunk
(`chat.completion.chunk`), with logprobs and usage.

A request with P prompts and n sequences each has P x n choices, numbered prompt * n + sequence.
Token strings in logprobs are vLLM's (each token decoded alone, special tokens shown); a
completion's `text_offset` indexes the returned text, found by replaying the detokenizer (token
strings do not add up to the text: a hidden special token, a character split over tokens).
"""

from __future__ import annotations

import time
import uuid

from toolkit.detokenizer import IncrementalDetokenizer
from toolkit.outputs import Logprob, RequestOutput
from toolkit.sampling_params import SamplingParams
from toolkit.server.engine_loop import SequenceDelta
from toolkit.server.protocol import Parsed


class Response:
    """One HTTP request's answer, built from its prompts' engine outputs."""

    def __init__(self, parsed: Parsed, tokenizer):
        self.parsed, self.tokenizer = parsed, tokenizer
        self.chat = parsed.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = parsed.params.n
        self.prompt_tokens = sum(len(p.token_ids) for p in parsed.prompts)
        self.completion_tokens = 0
        self._replays: dict[int, IncrementalDetokenizer] = {}  # completions' text offsets, per choice
        self._text_sent: dict[int, int] = {}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.parsed.model}

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    # --- whole ------------------------------------------------------------------------------------

    def body(self, finals: list[RequestOutput]) -> dict:
        """The non-streamed answer: `finals` in prompt order."""
        choices = []
        for p, final in enumerate(finals):
            for seq in final.outputs:
                index = p * self.n + seq.index
                self.completion_tokens += len(seq.token_ids)
                logprobs = self._logprobs(index, p, seq.token_ids, seq.logprobs, len(seq.text))
                choice = {"index": index, "logprobs": logprobs, "finish_reason": seq.finish_reason,
                          "stop_reason": seq.stop_reason}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": seq.text}
                else:
                    choice["text"] = seq.text
                choices.append(choice)
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": self.usage()}

    # --- streamed ---------------------------------------------------------------------------------

    def first_chunks(self) -> list[dict]:
        """Chat's first chunk of each choice names the role (OpenAI's stream shape)."""
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(len(self.parsed.prompts) * self.n)]

    def chunk(self, prompt: int, delta: SequenceDelta) -> dict:
        index = prompt * self.n + delta.index
        self.completion_tokens += len(delta.token_ids)
        sent = self._text_sent[index] = self._text_sent.get(index, 0) + len(delta.text)
        logprobs = self._logprobs(index, prompt, delta.token_ids, delta.logprobs, sent)
        choice = {"index": index, "logprobs": logprobs, "finish_reason": delta.finish_reason,
                  "stop_reason": delta.stop_reason}
        if self.chat:
            choice["delta"] = {"content": delta.text}
        else:
            choice["text"] = delta.text
        return self._chunk(choice)

    def _chunk(self, choice: dict | None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [] if choice is None else [choice]}

    def usage_chunk(self) -> dict:
        """stream_options.include_usage: the last chunk, with no choices and the whole request's usage."""
        return {**self._chunk(None), "usage": self.usage()}

    # --- logprobs ---------------------------------------------------------------------------------

    def _logprobs(self, index: int, prompt: int, token_ids: list[int], entries: list[dict[int, Logprob]] | None,
                  text_length: int) -> dict | None:
        if entries is None:
            return None
        top = self.parsed.top_logprobs or 0
        chosen = [entry[t] for t, entry in zip(token_ids, entries)]
        tokens = [_token(t, lp) for t, lp in zip(token_ids, chosen)]
        tops = [sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top] for entry in entries]
        if self.chat:
            return {"content": [{**_entry(tok, lp.logprob), "top_logprobs": [_entry(_token(t, v), v.logprob)
                                                                             for t, v in alternatives]}
                                for tok, lp, alternatives in zip(tokens, chosen, tops)]}
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in chosen],
                "top_logprobs": [{_token(t, v): v.logprob for t, v in alternatives} for alternatives in tops],
                "text_offset": self._text_offsets(index, prompt, token_ids, text_length)}

    def _text_offsets(self, index: int, prompt: int, token_ids: list[int], text_length: int) -> list[int]:
        """Where each token's text starts in the choice's text (of `text_length` characters so far)."""
        if self.tokenizer is None:
            return [0] * len(token_ids)
        replay = self._replays.get(index)
        if replay is None:
            params = SamplingParams(skip_special_tokens=self.parsed.params.skip_special_tokens)
            replay = self._replays[index] = IncrementalDetokenizer(self.tokenizer,
                                                                   self.parsed.prompts[prompt].token_ids, params)
        offsets = []
        for token in token_ids:
            offsets.append(min(len(replay.output_text), text_length))
            replay.add_tokens([token])
        return offsets


def _token(token_id: int, logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else str(token_id)


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
