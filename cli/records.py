"""Output lines for plain-text and JSONL inputs (OpenAI Batch inputs get `OpenAIRecords`).

Every record carries the input's id and its line number: records are written in completion
order, not input order, and `line` is also what a resumed run uses to skip finished lines.
"""

from __future__ import annotations

from toolkit.cli.jobs import Job
from toolkit.outputs import CompletionOutput, RequestOutput


class NativeRecords:
    def success(self, job: Job, out: RequestOutput) -> dict:
        completion = sum(len(c.token_ids) for c in out.outputs)
        record = {"id": job.id, "line": job.line}
        if job.prompt is not None:  # the text given, or a chat line's rendered template; none for token ids
            record["prompt"] = job.prompt
        return record | {
            "outputs": [_completion(c) for c in out.outputs],
            "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion,
                      "total_tokens": len(out.prompt_token_ids) + completion},
            "metrics": _metrics(out),
            "error": None,
        }

    def failure(self, job: Job, message: str) -> dict:
        return {"id": job.id, "line": job.line, "outputs": None, "error": message}


def record_id(record: dict):
    """The input id a record answers, in either output format."""
    return record["custom_id"] if "custom_id" in record else record.get("id")


def _completion(c: CompletionOutput) -> dict:
    out = {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
           "stop_reason": c.stop_reason}
    if c.logprobs is not None:
        # JSON object keys are strings: {"token id": logprob} per generated token (the shape records
        # had before Logprob objects: resumed runs append to older files).
        out["logprobs"] = [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs]
        out["cumulative_logprob"] = c.cumulative_logprob
    return out


def _metrics(out: RequestOutput) -> dict:
    m = out.metrics
    if m is None:
        return {}
    ttft, e2e = m.ttft, m.e2e_latency
    return {"ttft_s": None if ttft is None else round(ttft, 6), "e2e_s": None if e2e is None else round(e2e, 6)}
