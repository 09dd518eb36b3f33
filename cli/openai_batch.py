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
from toolkit.outputs import RequestOutput
from toolkit.sampling_params import SamplingParams

URLS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
REQUEST_KEYS = {"custom_id", "method", "url", "body"}
# Fields that do not change what is generated: accepted and not used.
IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options"}
# Fields accepted only at their "off" value: anything else asks for a feature this toolkit lacks.
OFF_VALUES = {"stream": (None, False), "echo": (None, False), "logit_bias": (None, {}), "suffix": (None, ""),
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
        job = Job(line=line, id=custom_id, kind=kind)
        body = dict(obj["body"])
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
    # OpenAI allows a batch of prompts in one request; one prompt per line keeps one record per line.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise LineError("prompt is empty")
        job.prompt = prompt
    elif isinstance(prompt, list):
        job.prompt_token_ids = token_ids(prompt, "prompt")
    else:
        raise LineError("prompt must be a string or a list of token ids (one prompt per line)")


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

    def success(self, job: Job, out: RequestOutput) -> dict:
        chat = job.kind == "chat"
        completion = sum(len(c.token_ids) for c in out.outputs)
        body = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [self._choice(c, chat, job.params.logprobs) for c in out.outputs],
            "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion,
                      "total_tokens": len(out.prompt_token_ids) + completion},
        }
        response = {"status_code": 200, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": job.id, "response": response,
                "error": None, "line": job.line}

    def failure(self, job: Job, message: str) -> dict:
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": job.id, "response": None,
                "error": {"code": "invalid_request", "message": message}, "line": job.line}

    def _choice(self, c, chat: bool, top_k: int | None) -> dict:
        logprobs = None if c.logprobs is None else self._logprobs(c, chat, top_k or 0)
        if chat:
            message = {"role": "assistant", "content": c.text}
            return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason}
        return {"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def _logprobs(self, c, chat: bool, top_k: int) -> dict:
        tokens = [self._token(t) for t in c.token_ids]
        chosen = [lp[t] for t, lp in zip(c.token_ids, c.logprobs)]
        tops = [sorted(lp.items(), key=lambda kv: -kv[1])[:top_k] for lp in c.logprobs]
        if chat:
            return {"content": [
                {**self._entry(tok, lp), "top_logprobs": [self._entry(self._token(t), v) for t, v in top]}
                for tok, lp, top in zip(tokens, chosen, tops)
            ]}
        offsets, at = [], 0
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"tokens": tokens, "token_logprobs": chosen, "text_offset": offsets,
                "top_logprobs": [{self._token(t): v for t, v in top} for top in tops]}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    @staticmethod
    def _entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
