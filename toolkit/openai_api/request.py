"""An OpenAI request body (`/v1/completions` or `/v1/chat/completions`) read into what it asks for.

OpenAI's fields and vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ...) map onto
SamplingParams keywords. A field that would change the answer and is not implemented is refused,
never ignored; so is an unknown field. Each caller adds its own defaults under the body's fields
and tokenizes the prompts when it can (the server at once, a batch file once the model is loaded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.tokenizer import chat_messages

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


class BodyError(ValueError):
    """What is wrong with a request body; `param` names the field at fault (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class OpenAIRequest:
    kind: str  # "completion" | "chat"
    model: str | None  # the name the body gives, if any
    fields: dict  # the SamplingParams keywords the body sets
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    prompts: list[str | list[int]] = field(default_factory=list)  # completion: each as given, text or token ids
    messages: list[dict] | None = None  # chat: checked and normalized
    add_generation_prompt: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)


def read_body(body, kind: str) -> OpenAIRequest:
    """An OpenAI body for `kind` ("completion" or "chat"), checked; raises BodyError."""
    if not isinstance(body, dict):
        raise BodyError("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise BodyError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}",
                        param=unknown[0])
    for key, allowed in OFF_VALUES.items():
        if body.get(key) not in allowed:
            raise BodyError(f"{key} is not supported", param=key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BodyError(f"model must be a string, got {type(model).__name__}", param="model")
    stream = _flag(body, "stream")
    request = OpenAIRequest(kind, model, sampling_fields(body, kind), stream, _include_usage(body, stream))
    if kind == "chat":
        _read_chat(body, request)
    else:
        request.prompts = _completion_prompts(body)
    return request


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is not None and not isinstance(value, bool):
        raise BodyError(f"{key} must be true or false, got {value!r}", param=key)
    return bool(value)


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is not None and not stream:
        raise BodyError("stream_options is only allowed with stream: true", param="stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage",
                                                                                  "continuous_usage_stats"}):
        raise BodyError("stream_options must be an object with include_usage", param="stream_options")
    return bool(options and options.get("include_usage"))


def _completion_prompts(body: dict) -> list[str | list[int]]:
    if "prompt" not in body:
        raise BodyError("a completion request needs a prompt", param="prompt")
    prompt = body["prompt"]
    # OpenAI's batch of prompts: a list of strings or of token-id lists (a flat list is one prompt's ids).
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [_one_prompt(p) for p in prompt]
    if isinstance(prompt, (str, list)):
        return [_one_prompt(prompt)]
    raise BodyError("prompt must be a string, a list of token ids, or a list of either", param="prompt")


def _one_prompt(prompt: str | list) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise BodyError("prompt is empty", param="prompt")
        return prompt
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise BodyError("a prompt must be a string or a list of integer token ids", param="prompt")
    return prompt


def _read_chat(body: dict, request: OpenAIRequest) -> None:
    if "messages" not in body:
        raise BodyError("a chat request needs messages", param="messages")
    try:
        request.messages = chat_messages(body.get("messages"))
    except ValueError as e:
        raise BodyError(str(e), param="messages") from None
    if "add_generation_prompt" in body:
        request.add_generation_prompt = _flag(body, "add_generation_prompt")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BodyError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    request.chat_template_kwargs = kwargs


def sampling_fields(body: dict, kind: str) -> dict:
    """The SamplingParams keywords the body sets (a null field is one it leaves to the defaults)."""
    fields = {k: body[k] for k in SAMPLING if body.get(k) is not None}
    if body.get("best_of") not in (None, fields.get("n", 1)):
        raise BodyError("best_of other than n is not supported", param="best_of")
    if kind == "completion":
        if body.get("logprobs") is not None:
            fields["logprobs"] = body["logprobs"]
        return fields
    if body.get("max_completion_tokens") is not None:
        fields["max_tokens"] = body["max_completion_tokens"]
    # Chat says logprobs: true plus top_logprobs: k; completions says logprobs: k.
    wanted, top = _flag(body, "logprobs"), body.get("top_logprobs")
    if top is not None and not wanted:
        raise BodyError("top_logprobs needs logprobs: true", param="top_logprobs")
    if wanted:
        fields["logprobs"] = 0 if top is None else top
    return fields
