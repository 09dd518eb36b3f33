"""OpenAI request bodies in, for the server: read (toolkit/openai_api/request.py), tokenized, and
mapped onto SamplingParams.

A field the request does not give takes the checkpoint's generation_config.json default where it
sets one (as vLLM does), else OpenAI's. What is the server's own: the served model's name, prompts
tokenized and checked against the engine at once, a cap on logprobs, and HTTP-shaped errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.openai_api.request import BodyError, OpenAIRequest, read_body
from toolkit.sampling_params import SamplingParams
from toolkit.tokenizer import render_chat

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: each one costs a sort over the vocabulary per token


class RequestError(Exception):
    """A request the server answers with an OpenAI-shaped error instead of a result."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


@dataclass
class Parsed:
    kind: str  # "completion" | "chat"
    model: str
    prompts: list[Prompt]
    params: SamplingParams
    stream: bool
    include_usage: bool


class Front:
    """What parsing needs of the served model: its name, a tokenizer of the front end's own (the
    engine's is used by the engine thread), the prompt checks and the default sampling fields."""

    def __init__(self, engine, model_name: str, defaults: dict):
        import copy

        self.engine, self.model_name, self.defaults = engine, model_name, defaults
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.max_model_len = engine.max_model_len

    def check_model(self, body: dict) -> str:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                               param="model")
        return self.model_name

    def encode(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, str):
            self.need_tokenizer()
            return self.check(Prompt(prompt, self.tokenizer(prompt)["input_ids"]))
        return self.check(Prompt(None, prompt))

    def check(self, prompt: Prompt) -> Prompt:
        try:
            self.engine.validate_prompt(prompt.token_ids)
        except ValueError as e:
            raise RequestError(str(e), param="prompt") from None
        return prompt

    def need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: send token ids")


def parse(body, kind: str, front: Front) -> Parsed:
    """An OpenAI body for `kind` ("completion" or "chat"), checked, its prompts tokenized."""
    try:
        request = read_body(body, kind)
    except BodyError as e:
        raise RequestError(str(e), param=e.param) from None
    model = front.check_model(body)
    prompts = _chat_prompt(request, front) if kind == "chat" else [front.encode(p) for p in request.prompts]
    fields = {"max_tokens": 16 if kind == "completion" else None, **front.defaults, **request.fields}
    for name in ("logprobs", "prompt_logprobs"):
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_LOGPROBS:
            raise RequestError(f"{name} must be at most {MAX_LOGPROBS}, got {value}", param=name)
    try:
        params = SamplingParams(**fields)
        params.check_vocab(front.engine.model_config.vocab_size)
    except (TypeError, ValueError) as e:
        raise RequestError(str(e)) from None
    for p in prompts:
        _check_length(p, params, front.max_model_len)
    return Parsed(kind, model, prompts, params, request.stream, request.include_usage)


def _chat_prompt(request: OpenAIRequest, front: Front) -> list[Prompt]:
    front.need_tokenizer()
    add, kwargs = request.add_generation_prompt, request.chat_template_kwargs
    try:
        ids = render_chat(front.tokenizer, request.messages, add, **kwargs)
        text = front.tokenizer.apply_chat_template(request.messages, add_generation_prompt=add, tokenize=False,
                                                   **kwargs)
    except Exception as e:  # noqa: BLE001  a template failing on these messages is the request's problem
        raise RequestError(f"the chat template failed on these messages: {e}", param="messages") from None
    return [front.check(Prompt(text, list(ids)))]


def _check_length(prompt: Prompt, params: SamplingParams, max_model_len: int) -> None:
    if params.max_tokens is not None and len(prompt.token_ids) + params.max_tokens > max_model_len:
        raise RequestError(
            f"this model's maximum context length is {max_model_len} tokens, but {len(prompt.token_ids) + params.max_tokens}"
            f" were requested ({len(prompt.token_ids)} in the prompt, {params.max_tokens} in the completion); "
            "shorten the prompt or lower max_tokens", param="max_tokens")
