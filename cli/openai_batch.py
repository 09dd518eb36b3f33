"""The OpenAI Batch API file format, both ways: request lines in, response lines out.

A request line is {"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}, as uploaded to hosted batch APIs or given to vLLM's run_batch. The body is read as
the HTTP server reads it (toolkit/openai_api/request.py) and answered as the server answers it
(toolkit/openai_api/response.py); this file keeps only the envelope, what a file cannot do (stream),
and errors that name the line.
"""

from __future__ import annotations

import uuid

from toolkit.cli.jobs import Job, LineError, failed, load_object, with_overrides
from toolkit.openai_api.request import BodyError, OpenAIRequest, read_body
from toolkit.openai_api.response import OpenAIResponse
from toolkit.outputs import RequestOutput
from toolkit.sampling_params import SamplingParams

URLS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
REQUEST_KEYS = {"custom_id", "method", "url", "body"}


def parse_request(line: int, raw: bytes, base: SamplingParams) -> Job:
    """One request line; the body's sampling fields override the run's `base`."""
    obj: dict = {}
    try:
        obj = load_object(raw)
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise LineError("custom_id must be a non-empty string")
        _check_envelope(obj)
        kind = URLS[obj["url"]]
        request = _read_body(obj["body"], kind)
        job = Job(line=line, id=custom_id, kind=kind, model=request.model)
        _set_prompt(job, request)
        job.params, job.own_seed = with_overrides(base, request.fields), "seed" in request.fields
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


def _read_body(body: dict, kind: str) -> OpenAIRequest:
    try:
        request = read_body(body, kind)
    except BodyError as e:
        raise LineError(str(e)) from None
    if request.stream:  # a file's answer is written whole
        raise LineError("stream is not supported")
    # The chat template is rendered once the model is loaded (cli/jobs.py encode), with its defaults.
    if not request.add_generation_prompt:
        raise LineError("add_generation_prompt: false is not supported in a batch file")
    if request.chat_template_kwargs:
        raise LineError("chat_template_kwargs is not supported in a batch file")
    return request


def _set_prompt(job: Job, request: OpenAIRequest) -> None:
    if job.kind == "chat":
        job.messages = request.messages
    elif len(request.prompts) > 1:
        job.prompts = request.prompts  # one engine request each, answered together (cli/jobs.py parts)
    elif isinstance(request.prompts[0], str):
        job.prompt = request.prompts[0]
    else:
        job.prompt_token_ids = request.prompts[0]


class OpenAIRecords:
    """Output lines in the OpenAI Batch output format, one per request line."""

    def __init__(self, model_name: str, tokenizer):
        self.model_name = model_name
        self.tokenizer = tokenizer

    def success(self, job: Job, out: RequestOutput | list[RequestOutput]) -> dict:
        """`out`: a list for a list of prompts; its choices go in prompt order, numbered prompt * n + i."""
        outs = out if isinstance(out, list) else [out]
        model = job.model or self.model_name  # the name the request used, as a server answers
        answer = OpenAIResponse(job.kind, model, [o.prompt_token_ids for o in outs], job.params, self.tokenizer)
        response = {"status_code": 200, "request_id": f"req_{uuid.uuid4().hex}", "body": answer.body(outs)}
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": job.id, "response": response,
                "error": None, "line": job.line}

    def failure(self, job: Job, message: str) -> dict:
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": job.id, "response": None,
                "error": {"code": "invalid_request", "message": message}, "line": job.line}
