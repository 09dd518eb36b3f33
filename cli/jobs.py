"""One input line -> one `Job`: the prompt, its sampling parameters, or the error that stops it.

Parsing never raises: a bad line becomes a Job with `error` set (naming the line), so one bad line
in a million costs one error record, not the job. Tokenizing needs the model and happens later,
in `encode`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from toolkit.sampling_params import SamplingParams
from toolkit.tokenizer import chat_messages, render_chat

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")


class LineError(ValueError):
    """What is wrong with one input line (the caller adds the line number)."""


@dataclass
class Job:
    line: int
    id: Any  # what the output record carries: custom_id, the JSONL "id", or the line number
    kind: str = "completion"  # "completion" | "chat": decides the OpenAI response object
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    params: SamplingParams | None = None
    error: str | None = None  # set: the line cannot run; the message starts with "line N:"
    own_seed: bool = False  # the line gave its own "seed" (else the run's --seed is derived per line)
    # OpenAI's list of prompts (strings or token-id lists) in one /v1/completions body: one engine
    # request each (`parts`), answered together in one record.
    prompts: list[str | list[int]] | None = None
    model: str | None = None  # an OpenAI body's "model": what its response reports
    input_sha: str | None = None  # the raw line's fingerprint, recorded so a resume can check it (cli/fingerprint.py)


def parts(job: Job) -> list[Job]:
    """The one-prompt jobs a job runs as: itself, or one per prompt of its list of prompts."""
    if job.prompts is None:
        return [job]
    return [dataclasses.replace(job, prompts=None, prompt=p if isinstance(p, str) else None,
                                prompt_token_ids=None if isinstance(p, str) else p) for p in job.prompts]


def failed(line: int, job_id: Any, message: str) -> Job:
    return Job(line=line, id=job_id, error=f"line {line}: {message}")


def decode_line(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LineError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None


def load_object(raw: bytes) -> dict:
    try:
        obj = json.loads(decode_line(raw))
    except json.JSONDecodeError as e:
        raise LineError(f"invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def text_job(line: int, raw: bytes, params: SamplingParams) -> Job:
    """Plain text: the whole line is the prompt, and the line number is its id."""
    try:
        return Job(line=line, id=line, prompt=decode_line(raw), params=params)
    except LineError as e:
        return failed(line, line, str(e))


def jsonl_job(line: int, raw: bytes, base: SamplingParams) -> Job:
    """{"id", "prompt" | "messages" | "prompt_token_ids", ...SamplingParams fields}; id defaults to the line number."""
    obj: dict = {}
    try:
        obj = load_object(raw)
        job_id = obj.get("id", line)
        if isinstance(job_id, bool) or not isinstance(job_id, (str, int)):
            raise LineError(f"id must be a string or an integer, got {job_id!r}")
        overrides = {k: v for k, v in obj.items() if k != "id" and k not in PROMPT_FIELDS}
        job = Job(line=line, id=job_id, params=with_overrides(base, overrides), own_seed="seed" in overrides)
        set_prompt(job, obj)
        return job
    except LineError as e:
        return failed(line, _safe_id(obj.get("id"), line), str(e))


def set_prompt(job: Job, obj: dict) -> None:
    """Exactly one of prompt / messages / prompt_token_ids, checked for shape."""
    given = [k for k in PROMPT_FIELDS if k in obj]
    if len(given) != 1:
        raise LineError(f"needs exactly one of {', '.join(PROMPT_FIELDS)}; got {', '.join(given) or 'none'}")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise LineError("prompt must be a string (use prompt_token_ids for token ids)")
        if not obj["prompt"]:
            raise LineError("prompt is empty")
        job.prompt = obj["prompt"]
    elif "messages" in obj:
        job.kind = "chat"
        job.messages = normalize_messages(obj["messages"])
    else:
        job.prompt_token_ids = token_ids(obj["prompt_token_ids"], "prompt_token_ids")


def line_seed(seed: int, job_id: Any) -> int:
    """The seed of the line with this id under `--seed seed`: a function of both alone, so a line
    samples the same after a resume and repeated prompts (pass@k) sample differently."""
    digest = hashlib.blake2b(f"{seed}:{type(job_id).__name__}:{job_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def with_line_seed(job: Job, base: SamplingParams) -> Job:
    if job.error is None and base.seed is not None and not job.own_seed:
        job.params = dataclasses.replace(job.params, seed=line_seed(base.seed, job.id))
    return job


def with_overrides(base: SamplingParams, overrides: dict) -> SamplingParams:
    """The run's parameters with this line's fields replaced; unknown fields and bad values are errors."""
    unknown = sorted(set(overrides) - SAMPLING_FIELDS)
    if unknown:
        raise LineError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}")
    if not overrides:
        return base  # shared: validating the same parameters again for every line is wasted work
    try:
        return dataclasses.replace(base, **overrides)
    except (TypeError, ValueError) as e:
        raise LineError(str(e)) from None


def normalize_messages(messages) -> list[dict]:
    try:
        return chat_messages(messages)
    except ValueError as e:
        raise LineError(str(e)) from None


def token_ids(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise LineError(f"{name} must be a list of integers")
    return value


def encode(engine, job: Job) -> list[int]:
    """The job's prompt as token ids, checked against the model (vocabulary, max_model_len). A chat
    job's `prompt` becomes the text its chat template rendered (what its record carries, as vLLM's
    RequestOutput.prompt does)."""
    try:
        if job.prompt_token_ids is not None:
            ids = job.prompt_token_ids
        elif job.messages is not None:
            ids = render_chat(engine.tokenizer, job.messages)
            job.prompt = engine.tokenizer.apply_chat_template(job.messages, add_generation_prompt=True,
                                                              tokenize=False)
        else:
            ids = engine.tokenize(job.prompt)
    except LineError:
        raise
    except Exception as e:  # a chat template or tokenizer failing on one line must not end the whole job
        raise LineError(f"could not tokenize the prompt: {e}") from None
    try:
        engine.validate_prompt(ids, "prompt")
        if job.params is not None:  # logit_bias and allowed_token_ids name ids of this model's vocabulary
            job.params.check_vocab(engine.model_config.vocab_size)
    except ValueError as e:
        raise LineError(str(e)) from None
    return ids


def _safe_id(value, line: int):
    return value if isinstance(value, (str, int)) and not isinstance(value, bool) else line
