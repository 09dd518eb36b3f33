"""An OpenAI answer (`text_completion`, `chat.completion`) built from engine outputs: choices, logprobs, usage.

A request with P prompts and n sequences each has P x n choices, numbered prompt * n + sequence.
A choice is built from a whole sequence (a CompletionOutput) or from what it gained in a step
(the server's stream): the same fields, so a streamed answer adds up to the whole one.
Token strings in logprobs are vLLM's (each token decoded alone, special tokens shown, as OpenAI
shows them); a completion's `text_offset` indexes the returned text, found by replaying the
detokenizer (token strings do not add up to the text: a hidden special token, a character split
over tokens, a stop string cut).
"""

from __future__ import annotations

import time
import uuid

from toolkit.detokenizer import IncrementalDetokenizer
from toolkit.outputs import Logprob, RequestOutput
from toolkit.sampling_params import SamplingParams


class OpenAIResponse:
    """One request's answer. `prompt_token_ids`: each prompt's ids, in prompt order."""

    def __init__(self, kind: str, model: str, prompt_token_ids: list[list[int]], params: SamplingParams,
                 tokenizer):
        self.chat = kind == "chat"
        self.model, self.prompt_token_ids, self.params, self.tokenizer = model, prompt_token_ids, params, tokenizer
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = params.n
        self.prompt_tokens = sum(len(ids) for ids in prompt_token_ids)
        self.completion_tokens = 0
        self._replays: dict[int, IncrementalDetokenizer] = {}  # completions' text offsets, per choice

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def body(self, finals: list[RequestOutput]) -> dict:
        """The whole answer: `finals` in prompt order."""
        choices = []
        for p, final in enumerate(finals):
            for seq in final.outputs:
                choice = self.choice(p, seq, len(seq.text))
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": seq.text}
                choices.append(choice)
        return {**self.head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": self.usage()}

    def choice(self, prompt: int, seq, text_length: int) -> dict:
        """A choice from `seq` (a CompletionOutput, or a step's part of one: index, token_ids, text,
        logprobs, finish_reason, stop_reason), its tokens counted in the usage. `text_length`: the
        choice's text so far, `seq.text` included. Chat's text goes in the caller's message or delta."""
        index = prompt * self.n + seq.index
        self.completion_tokens += len(seq.token_ids)
        choice = {"index": index, "logprobs": self._logprobs(index, prompt, seq.token_ids, seq.logprobs, text_length),
                  "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
        if not self.chat:
            choice["text"] = seq.text
        return choice

    def _logprobs(self, index: int, prompt: int, token_ids: list[int], entries: list[dict[int, Logprob]] | None,
                  text_length: int) -> dict | None:
        if entries is None:
            return None
        top = self.params.logprobs or 0
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
        """Where each token's text starts in the choice's text (of `text_length` characters so far): the
        text replayed as the engine built it, so a token that adds nothing gets the length so far."""
        if self.tokenizer is None:
            return [0] * len(token_ids)  # no text
        replay = self._replays.get(index)
        if replay is None:
            params = SamplingParams(skip_special_tokens=self.params.skip_special_tokens)
            replay = self._replays[index] = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids[prompt],
                                                                   params)
        offsets = []
        for token in token_ids:
            offsets.append(min(len(replay.output_text), text_length))
            replay.add_tokens([token])
        return offsets


def _token(token_id: int, logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else str(token_id)


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
