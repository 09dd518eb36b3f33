"""OpenAI request bodies in: checked, tokenized, and mapped onto SamplingParams.

`/v1/completions` and `/v1/chat/completions` take OpenAI's fields and vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, ...). A field that would change the answer and is not implemented
is refused (400), never ignored; so is an unknown field. Fields the request does not give take the
checkpoint's generation_config.json defaults where it sets them (as vLLM does), else OpenAI's.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.sampling_params import SamplingParams
from toolkit.tokenizer import chat_messages, render_chat

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: each one costs a sort over the vocabulary per token

# Fields both endpoints map straight onto SamplingParams (OpenAI's, then vLLM's extras).
SAMPLING = ("n", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
            "max_tokens", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
            "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids", "prompt_logprobs")
# Fields that do not change what is generated: accepted, not used.
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
# Fields taken only at their "off" value: anything else asks for something not implemented.
OFF_VALUES = {"echo": (None, False), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
              "response_format": (None, {"type": "text"}), "functions": (None, []), "function_call": (None, "none")}
COMMON = {"model", "stream", "stream_options", "best_of", *SAMPLING, *IGNORED}
FIELDS = {"completion": COMMON | {"prompt", "logprobs", "echo", "suffix"},
          "chat": COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "add_generation_prompt",
                            "chat_template_kwargs", "tools", "tool_choice", "response_format", "functions",
                            "function_call"}}


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
    top_logprobs: int | None  # chat: how many alternatives per token to show (logprobs: true)


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

    def encode(self, prompt) -> Prompt:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty", param="prompt")
            self.need_tokenizer()
            return self.check(Prompt(prompt, self.tokenizer(prompt)["input_ids"]))
        return self.check(Prompt(None, _token_ids(prompt)))

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
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise RequestError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}",
                           param=unknown[0])
    for key, allowed in OFF_VALUES.items():
        if body.get(key) not in allowed:
            raise RequestError(f"{key} is not supported", param=key)
    model = front.check_model(body)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage",
                                                                                  "continuous_usage_stats"}):
        raise RequestError("stream_options must be an object with include_usage", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    prompts = _chat_prompt(body, front) if kind == "chat" else _completion_prompts(body, front)
    fields, top = _sampling_fields(body, kind, front.defaults)
    try:
        params = SamplingParams(**fields)
        params.check_vocab(front.engine.model_config.vocab_size)
    except (TypeError, ValueError) as e:
        raise RequestError(str(e)) from None
    for p in prompts:
        _check_length(p, params, front.max_model_len)
    return Parsed(kind, model, prompts, params, stream, include_usage, top)


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false, got {value!r}", param=key)
    return bool(value)


def _completion_prompts(body: dict, front: Front) -> list[Prompt]:
    if "prompt" not in body:
        raise RequestError("a completion request needs a prompt", param="prompt")
    prompt = body["prompt"]
    # OpenAI's batch of prompts: a list of strings or of token-id lists (a flat list is one prompt's ids).
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [front.encode(p) for p in prompt]
    if isinstance(prompt, (str, list)):
        return [front.encode(prompt)]
    raise RequestError("prompt must be a string, a list of token ids, or a list of either", param="prompt")


def _chat_prompt(body: dict, front: Front) -> list[Prompt]:
    front.need_tokenizer()
    try:
        messages = chat_messages(body.get("messages"))
    except ValueError as e:
        raise RequestError(str(e), param="messages") from None
    add = _flag(body, "add_generation_prompt") if "add_generation_prompt" in body else True
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    try:
        ids = render_chat(front.tokenizer, messages, add, **kwargs)
        text = front.tokenizer.apply_chat_template(messages, add_generation_prompt=add, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001  a template failing on these messages is the request's problem
        raise RequestError(f"the chat template failed on these messages: {e}", param="messages") from None
    return [front.check(Prompt(text, list(ids)))]


def _sampling_fields(body: dict, kind: str, defaults: dict) -> tuple[dict, int | None]:
    """SamplingParams keywords: the server's defaults, then the request's fields; and chat's top_logprobs."""
    fields = {"max_tokens": 16 if kind == "completion" else None, **defaults}
    fields.update({k: body[k] for k in SAMPLING if body.get(k) is not None})
    n = fields.get("n", 1)
    if body.get("best_of") not in (None, n):
        raise RequestError("best_of other than n is not supported", param="best_of")
    top = None
    if kind == "chat":
        if body.get("max_completion_tokens") is not None:
            fields["max_tokens"] = body["max_completion_tokens"]
        # Chat says logprobs: true plus top_logprobs: k; completions says logprobs: k.
        wanted, top = _flag(body, "logprobs"), body.get("top_logprobs")
        if top is not None and not wanted:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        if wanted:
            top = 0 if top is None else top
            fields["logprobs"] = top
    elif body.get("logprobs") is not None:
        fields["logprobs"] = top = body["logprobs"]
    for name in ("logprobs", "prompt_logprobs"):
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_LOGPROBS:
            raise RequestError(f"{name} must be at most {MAX_LOGPROBS}, got {value}", param=name)
    return fields, top


def _check_length(prompt: Prompt, params: SamplingParams, max_model_len: int) -> None:
    if params.max_tokens is not None and len(prompt.token_ids) + params.max_tokens > max_model_len:
        raise RequestError(
            f"this model's maximum context length is {max_model_len} tokens, but {len(prompt.token_ids) + params.max_tokens}"
            f" were requested ({len(prompt.token_ids)} in the prompt, {params.max_tokens} in the completion); "
            "shorten the prompt or lower max_tokens", param="max_tokens")


def _token_ids(value) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise RequestError("a prompt must be a string or a list of integer token ids", param="prompt")
    return value
