"""The server's answers: whole, or streamed chunk by chunk (`chat.completion.chunk`, or
`text_completion` pieces), each chunk's choice built as a whole answer's is (toolkit/openai_api/response.py)
from what the sequence gained in a step.
"""

from __future__ import annotations

from toolkit.openai_api.response import OpenAIResponse
from toolkit.server.engine_loop import SequenceDelta
from toolkit.server.protocol import Parsed


class Response(OpenAIResponse):
    """One HTTP request's answer, built from its prompts' engine outputs."""

    def __init__(self, parsed: Parsed, tokenizer):
        super().__init__(parsed.kind, parsed.model, [p.token_ids for p in parsed.prompts], parsed.params, tokenizer)
        self.parsed = parsed
        self._text_sent: dict[int, int] = {}  # per choice: the text streamed so far

    def first_chunks(self) -> list[dict]:
        """Chat's first chunk of each choice names the role (OpenAI's stream shape)."""
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(len(self.parsed.prompts) * self.n)]

    def chunk(self, prompt: int, delta: SequenceDelta) -> dict:
        index = prompt * self.n + delta.index
        sent = self._text_sent[index] = self._text_sent.get(index, 0) + len(delta.text)
        choice = self.choice(prompt, delta, sent)
        if self.chat:
            choice["delta"] = {"content": delta.text}
        return self._chunk(choice)

    def _chunk(self, choice: dict | None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self.head(obj), "choices": [] if choice is None else [choice]}

    def usage_chunk(self) -> dict:
        """stream_options.include_usage: the last chunk, with no choices and the whole request's usage."""
        return {**self._chunk(None), "usage": self.usage()}
