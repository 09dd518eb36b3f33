"""The generate loop: feed jobs to the engine a window at a time, step it, write each result as it finishes.

The engine is driven directly (add_request / step) rather than through `LLM.generate`, which returns
only when everything is done: here every finished request is written at once, so output streams,
and a killed run loses only what was in flight. At most `window` requests are inside the engine,
so the input file is read lazily and a million-line input is never held in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from toolkit.cli.jobs import Job, LineError, encode, parts
from toolkit.cli.progress import Reporter
from toolkit.cli.stats import RunStats
from toolkit.engine import Engine
from toolkit.outputs import RequestOutput


class LineFailed(Exception):
    """--fail-fast: the first failed line ends the run."""


class BatchRunner:
    def __init__(self, engine: Engine, records, write: Callable[[dict], None], stats: RunStats,
                 reporter: Reporter, window: int, fail_fast: bool,
                 write_failure: Callable[[dict], None] | None = None):
        self.engine = engine
        self.records = records  # NativeRecords or OpenAIRecords: job + output -> output line
        self.write = write
        self.stats = stats
        self.reporter = reporter
        self.window = window
        self.fail_fast = fail_fast
        # A line that fails before reaching the engine is failed by every rank that reads it; with
        # several writers (disaggregated decode instances) one of them writes its record.
        self.write_failure = write_failure or write
        self.counts_failures = write_failure is None or write_failure is write
        self.pending: dict[str, Job] = {}  # engine request id -> its job
        self.finished_parts: dict[int, dict[str, RequestOutput]] = {}  # a list-of-prompts line's outputs so far

    def run(self, jobs: Iterable[Job]) -> None:
        jobs = iter(jobs)
        more = True
        while True:
            # What the engine holds: a disaggregated rank's engine holds (or awaits) only the requests
            # routed to its instance, while every rank reads every line.
            while more and self.engine.num_unfinished_requests < self.window:
                job = next(jobs, None)
                if job is None:
                    more = False
                else:
                    self._submit(job)
            # The engine holds exactly the pending requests, so this ends when they and the input are done;
            # asked of the engine (once per step) because replicas in lockstep (--dp with expert
            # parallelism) step until every replica is done (Engine.has_unfinished).
            if not self.engine.has_unfinished():
                break
            for out in self.engine.step():
                self._finish(self.pending.pop(out.request_id), out)

    def _submit(self, job: Job) -> None:
        if job.error is not None:
            self._fail(job, job.error, before_engine=True)
            return
        if job.prompts is not None and len(job.prompts) > 1 and self.engine.front.splits_lines:
            # Its prompts could go to different decode instances, which write separate shards.
            self._fail(job, f"line {job.line}: a list of prompts in one request is not supported with "
                            "disaggregated prefill/decode yet; give one prompt per line", before_engine=True)
            return
        jobs = parts(job)
        try:
            prompt_ids = [encode(self.engine, part) for part in jobs]  # all, before any of them runs
        except LineError as e:
            self._fail(job, f"line {job.line}: {e}", before_engine=True)
            return
        # The line number is unique in the file and stable across resumed runs.
        request_ids = [str(job.line)] if job.prompts is None else [f"{job.line}.{i}" for i in range(len(jobs))]
        if job.prompts is not None:
            self.finished_parts[job.line] = {}
        for request_id, ids, part in zip(request_ids, prompt_ids, jobs):
            self.engine.add_request(request_id, ids, part.params, prompt=part.prompt)
            if self.engine.serves(request_id):
                self.pending[request_id] = job

    def _finish(self, job: Job, out: RequestOutput) -> None:
        outs = [out]
        if job.prompts is not None:  # one record once every prompt of the line is done
            done = self.finished_parts[job.line]
            done[out.request_id] = out
            if len(done) < len(job.prompts):
                return
            outs = [done[f"{job.line}.{i}"] for i in range(len(job.prompts))]
            del self.finished_parts[job.line]
        error = next((o.error for o in outs if o.error), None)
        if error:  # e.g. the scheduler found the request can never fit in the KV cache
            self._fail(job, f"line {job.line}: {error}")
            return
        self.write(self.records.success(job, out if job.prompts is None else outs))
        self.reporter.advance(sum(self.stats.add_output(o) for o in outs))

    def _fail(self, job: Job, message: str, before_engine: bool = False) -> None:
        if self.fail_fast:
            # Not written: once the line is fixed, a rerun with the same output redoes it.
            raise LineFailed(message)
        if before_engine and not self.counts_failures:
            return  # another rank writes and counts it
        (self.write_failure if before_engine else self.write)(self.records.failure(job, message))
        self.stats.add_error()
        self.reporter.error(message)
        self.reporter.advance(0)
