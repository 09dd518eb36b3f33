"""The OpenAI Batch API file format, both ways: request lines in, response lines out.

A request line is {"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}, as uploaded to hosted batch APIs or given to vLLM's run_batch. Body fields map to
SamplingParams (OpenAI's names, plus vLLM's extra sampling fields such as top_k and min_p); a field
that would change the meaning of the request and is not implemented is an error, never ignored.
"""

from __future__ import annotations

import time
import uuid

from toolkit.cli.jobs import Job, LineError, failed, load_object, normalize_messages, token_ids, with_overrides
from toolkit.detokenizer import IncrementalDetokenizer
from toolkit.outputs import CompletionOutput, Logprob, RequestOutput
from toolkit.sampling_params import SamplingParams

URLS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
REQUEST_KEYS = {"custom_id", "method", "url", "body"}
# Fields that do not change what is generated: accepted and not used.
IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options"}
# Fields accepted only at their "off" value: anything else asks for a feature this toolkit lacks.
OFF_VALUES = {"stream": (None, False), "echo": (None, False), "suffix": (None, ""),
              "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"})}


def parse_request(line: int, raw: bytes, base: SamplingParams) -> Job:
    obj: dict = {}
    try:
        obj = load_object(raw)
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise LineError("custom_id must be a non-empty string")
        _check_envelope(obj)
        kind = URLS[obj["url"]]
        body = dict(obj["body"])
        job = Job(line=line, id=custom_id, kind=kind, model=_model(body))
        _set_prompt(job, body)
        overrides = _sampling_overrides(body, kind)
        job.params, job.own_seed = with_overrides(base, overrides), "seed" in overrides
        return job
    except LineError as e:
        custom_id = obj.get("custom_id")
        return failed(line, custom_id if isinstance(custom_id, str) else None, str(e))


def _check_envelope(obj: dict) -> None:
    unknown = sorted(set(obj) - REQUEST_KEYS)
    if unknown:
        raise LineError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}")
    if obj.get("method", "POST") != "POST":
        raise LineError(f"method must be POST, got {obj.get('method')!r}")
    if obj.get("url") not in URLS:
        raise LineError(f"url must be one of {', '.join(URLS)}; got {obj.get('url')!r}")
    if not isinstance(obj.get("body"), dict):
        raise LineError("body must be a JSON object")


def _set_prompt(job: Job, body: dict) -> None:
    """Takes the prompt (completions) or messages (chat) out of body."""
    if job.kind == "chat":
        if "messages" not in body:
            raise LineError("a /v1/chat/completions body needs messages")
        job.messages = normalize_messages(body.pop("messages"))
        return
    if "prompt" not in body:
        raise LineError("a /v1/completions body needs prompt")
    prompt = body.pop("prompt")
    # OpenAI's batch of prompts: a list of strings or of token-id lists (a flat list is one prompt's ids).
    many = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    prompts = [_one_prompt(p) for p in prompt] if many else [_one_prompt(prompt)]
    if len(prompts) > 1:
        job.prompts = prompts
    elif isinstance(prompts[0], str):
        job.prompt = prompts[0]
    else:
        job.prompt_token_ids = prompts[0]


def _one_prompt(prompt) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise LineError("prompt is empty")
        return prompt
    if isinstance(prompt, list):
        return token_ids(prompt, "prompt")
    raise LineError("prompt must be a string, a list of token ids, or a list of either")


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise LineError(f"model must be a string, got {type(model).__name__}")
    return model


def _sampling_overrides(body: dict, kind: str) -> dict:
    body = {k: v for k, v in body.items() if k not in IGNORED}
    for key, allowed in OFF_VALUES.items():
        if key in body and body.pop(key) not in allowed:
            raise LineError(f"{key} is not supported")
    n = body.get("n", 1)
    best_of = body.pop("best_of", None)
    if best_of not in (None, n):
        raise LineError("best_of other than n is not supported")
    if "max_completion_tokens" in body:
        body["max_tokens"] = body.pop("max_completion_tokens")
    if kind == "chat":
        # Chat says logprobs: true plus top_logprobs: k; completions says logprobs: k.
        wanted, top = body.pop("logprobs", None), body.pop("top_logprobs", None)
        if wanted:
            body["logprobs"] = top or 0
    return body


# --- responses -----------------------------------------------------------------------------


class OpenAIRecords:
    """Output lines in the OpenAI Batch output format, one per request line."""

    def __init__(self, model_name: str, tokenizer):
        self.model_name = model_name
        self.tokenizer = tokenizer

    def success(self, job: Job, out: RequestOutput | list[RequestOutput]) -> dict:
        """`out`: a list for a list of prompts; its choices go in prompt order, numbered prompt * n + i."""
        outs = out if isinstance(out, list) else [out]
        chat = job.kind == "chat"
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        body = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": job.model or self.model_name,  # the name the request used, as a server answers
            "choices": [self._choice(c, p * job.params.n + c.index, o.prompt_token_ids, chat, job.params)
                        for p, o in enumerate(outs) for c in o.outputs],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        }
        response = {"status_code": 200, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": job.id, "response": response,
                "error": None, "line": job.line}

    def failure(self, job: Job, message: str) -> dict:
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": job.id, "response": None,
                "error": {"code": "invalid_request", "message": message}, "line": job.line}

    def _choice(self, c: CompletionOutput, index: int, prompt_ids: list[int], chat: bool,
                params: SamplingParams) -> dict:
        logprobs = None if c.logprobs is None else self._logprobs(c, prompt_ids, chat, params)
        if chat:
            message = {"role": "assistant", "content": c.text}
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason}
        return {"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def _logprobs(self, c: CompletionOutput, prompt_ids: list[int], chat: bool, params: SamplingParams) -> dict:
        # Token strings are vLLM's (each token decoded alone, special tokens shown, as OpenAI shows them).
        tokens = [_token(t, lp[t]) for t, lp in zip(c.token_ids, c.logprobs)]
        chosen = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
        tops = [sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:params.logprobs or 0] for lp in c.logprobs]
        if chat:
            return {"content": [
                {**self._entry(tok, lp), "top_logprobs": [self._entry(_token(t, v), v.logprob) for t, v in top]}
                for tok, lp, top in zip(tokens, chosen, tops)
            ]}
        return {"tokens": tokens, "token_logprobs": chosen, "text_offset": self._text_offsets(c, prompt_ids, params),
                "top_logprobs": [{_token(t, v): v.logprob for t, v in top} for top in tops]}

    def _text_offsets(self, c: CompletionOutput, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """Where each token's text starts in the returned text. Token strings do not add up to it (a
        special token hidden by skip_special_tokens, a character split over tokens, a stop string cut),
        so the text is replayed as the engine built it: a token that adds nothing gets the length so far."""
        if self.tokenizer is None:
            return [0] * len(c.token_ids)  # no text
        replay = IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                        SamplingParams(skip_special_tokens=params.skip_special_tokens))
        offsets = []
        for token in c.token_ids:
            offsets.append(min(len(replay.output_text), len(c.text)))
            replay.add_tokens([token])
        return offsets

    @staticmethod
    def _entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _token(token_id: int, logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else str(token_id)
