"""`toolkit generate`: one prompt to stdout, or a whole input file to an output JSONL that resumes."""

from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from toolkit.cli import options as o
from toolkit.cli.batch import BatchRunner, LineFailed
from toolkit.cli.default_model import resolve_model
from toolkit.cli.errors import EXIT_LINE_FAILED, CliError, exit_with, stderr_console
from toolkit.cli.fingerprint import RunFingerprint, Stamped, input_sha, run_fingerprint
from toolkit.cli.input_file import detect_format, iter_lines
from toolkit.cli.interrupts import describe, exit_code, interruptible
from toolkit.cli.jobs import Job, failed, jsonl_job, text_job, with_line_seed
from toolkit.cli.openai_batch import OpenAIRecords, parse_request
from toolkit.cli.output_file import (OutputLock, RecordWriter, Resume, existing_shards, merge_shards, resume_from,
                                     shard_path)
from toolkit.cli.progress import Reporter, ShardCounter
from toolkit.cli.records import NativeRecords
from toolkit.cli.resume_check import check_input_matches, check_run_matches
from toolkit.cli.stats import (RunStats, combine_handoff, combine_kv, combine_spec, kv_summary, print_summary,
                               summary_line)
from toolkit.sampling_params import SamplingParams


@dataclass
class IOArgs:
    prompt: str | None
    input: Path | None
    output: Path | None
    input_format: str
    fail_fast: bool
    quiet: bool
    window: int
    chat: bool | None = None  # a PROMPT through the chat template; None: when the model has one


@dataclass
class Ranks:
    """This process's place in a dp x pp x tp launch (tp innermost, then the pipeline stages, as
    parallel's mesh lays it out)."""

    tp: int = 1
    dp: int = 1
    rank: int = 0
    pp: int = 1
    # Disaggregated prefill/decode: prefill instances of prefill_pp x prefill_tp (default pp x tp) ranks,
    # then decode instances of dp replicas of pp x tp ranks; each replica's first rank writes its records.
    prefill: int = 0
    decode: int = 0
    prefill_tp: int | None = None
    prefill_pp: int | None = None
    prefill_serves: bool = False  # a prefill instance also serves whole requests (decode_token_cost)

    @property
    def world(self) -> int:
        if self.prefill:
            return self._first_decode + self.decode * self.dp * self.tp * self.pp
        return self.tp * self.dp * self.pp

    @property
    def _prefill_size(self) -> int:
        return (self.prefill_tp or self.tp) * (self.prefill_pp or self.pp)

    @property
    def _first_decode(self) -> int:
        return self.prefill * self._prefill_size

    @property
    def decode_instance(self) -> int | None:
        """Disaggregated: the index of this rank's decode instance (each replica one); None on a prefill rank."""
        first = self._first_decode
        return (self.rank - first) // (self.tp * self.pp) if self.prefill and self.rank >= first else None

    @property
    def shards(self) -> int:
        """Writers of shard files, merged into OUTPUT at the end (1: OUTPUT itself)."""
        if self.prefill:
            return self.decode * self.dp + (self.prefill if self.prefill_serves else 0)
        return self.dp

    @property
    def replica(self) -> int:
        return self.rank // (self.tp * self.pp)

    @property
    def line_share(self) -> tuple[int, int] | None:
        """(replica, replicas): the share of the input's lines this rank reads under --dp; None, every
        line (also for a disaggregated job, whose router needs every line on every rank)."""
        return (self.replica, self.dp) if self.dp > 1 and not self.prefill else None

    @property
    def main(self) -> bool:  # global rank 0: output (or the merge), progress, summary, resume scan
        return self.rank == 0

    @property
    def writer(self) -> bool:  # its replica's first rank (stage 0, TP rank 0): writes the replica's records
        if self.prefill:  # (disaggregated: its decode instance's first rank, or a serving prefill instance's)
            if self.decode_instance is None:
                return self.prefill_serves and self.rank % self._prefill_size == 0
            return (self.rank - self._first_decode) % (self.tp * self.pp) == 0
        return self.rank % (self.tp * self.pp) == 0

    @property
    def shard(self) -> int:
        """The shard this rank writes (with shards > 1): decode instances' first, then prefill instances'."""
        if not self.prefill:
            return self.replica
        if self.decode_instance is None:
            return self.decode * self.dp + self.rank // self._prefill_size
        return self.decode_instance

    @property
    def writes_failures(self) -> bool:
        """Whether the records of lines that fail before reaching the engine are this rank's to write
        (every rank reads every line under TP or disaggregation; one writes such a record)."""
        return self.writer and (not self.prefill or self.decode_instance == 0)


def generate(
    prompt: Annotated[Optional[str], typer.Argument(
        show_default=False, help="One prompt (by default a user message, through the model's chat template "
                                 "when it has one); the text is printed to stdout. Or use --input.")] = None,
    chat: Annotated[Optional[bool], typer.Option(
        "--chat/--no-chat", show_default=False,
        help="Send PROMPT as a user message through the model's chat template (--chat), or as text to complete "
             "(--no-chat). Default: --chat when the model has a chat template.")] = None,
    input: Annotated[Optional[Path], typer.Option(
        "--input", "-i", rich_help_panel=o.IO, show_default=False,
        help="Prompts file: plain text (one prompt per line), JSONL ({id, prompt|messages, ...sampling fields}) "
             "or OpenAI Batch API request lines. Blank lines are skipped.")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", rich_help_panel=o.IO, show_default=False,
        help="Output JSONL, one record per input line, in completion order, each with its id and line. "
             "Rerunning with the same output resumes: finished lines are skipped. Default: stdout.")] = None,
    input_format: Annotated[o.InputFormat, typer.Option(
        rich_help_panel=o.IO, help="Input format; auto looks at the first lines.")] = o.InputFormat.auto,
    fail_fast: Annotated[bool, typer.Option(
        "--fail-fast", rich_help_panel=o.IO, help="Stop at the first failed line instead of writing an error record.")] = False,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", rich_help_panel=o.IO, help="No progress bar or table; a one-line summary (for logs).")] = False,
    window: Annotated[int, typer.Option(
        min=1, rich_help_panel=o.IO, help="Requests handed to the engine at a time (bounds memory on huge inputs).")] = 4096,
    model: o.ModelOpt = None,
    dtype: o.DtypeOpt = "auto",
    quantization: o.QuantizationOpt = None,
    max_tokens: Annotated[int, typer.Option(min=1, rich_help_panel=o.SAMPLING, help="New tokens per completion.")] = 128,
    temperature: Annotated[float, typer.Option(
        rich_help_panel=o.SAMPLING, help="0 = greedy (OpenAI's API default is 1).")] = 0.0,
    top_p: Annotated[float, typer.Option(rich_help_panel=o.SAMPLING, help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(rich_help_panel=o.SAMPLING, help="Keep the k likeliest tokens; 0 = all.")] = 0,
    min_p: Annotated[float, typer.Option(rich_help_panel=o.SAMPLING, help="Drop tokens below min_p x the top probability.")] = 0.0,
    seed: Annotated[Optional[int], typer.Option(
        rich_help_panel=o.SAMPLING, show_default=False,
        help="Seed every request's sampling: results then do not depend on batching or resuming.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(
        rich_help_panel=o.SAMPLING, show_default=False, help="Stop string (repeatable); not included in the text.")] = None,
    stop_token_id: Annotated[Optional[list[int]], typer.Option(
        rich_help_panel=o.SAMPLING, show_default=False, help="Token id that ends generation (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", rich_help_panel=o.SAMPLING, help="Keep generating past EOS.")] = False,
    n: Annotated[int, typer.Option("-n", "--n", min=1, rich_help_panel=o.SAMPLING, help="Completions per prompt.")] = 1,
    min_tokens: Annotated[int, typer.Option(min=0, rich_help_panel=o.SAMPLING, help="Tokens before EOS may end it.")] = 0,
    repetition_penalty: Annotated[float, typer.Option(rich_help_panel=o.SAMPLING, help="1 = off.")] = 1.0,
    presence_penalty: Annotated[float, typer.Option(rich_help_panel=o.SAMPLING, help="In [-2, 2]; 0 = off.")] = 0.0,
    frequency_penalty: Annotated[float, typer.Option(rich_help_panel=o.SAMPLING, help="In [-2, 2]; 0 = off.")] = 0.0,
    logprobs: Annotated[Optional[int], typer.Option(
        min=0, rich_help_panel=o.SAMPLING, show_default=False, help="Also return the top-k logprobs of each token.")] = None,
    block_size: o.BlockSizeOpt = 16,
    max_num_seqs: o.MaxNumSeqsOpt = 256,
    max_num_batched_tokens: o.MaxBatchedTokensOpt = 2048,
    max_model_len: o.MaxModelLenOpt = None,
    kv_cache_memory: o.KVMemoryOpt = None,
    eager: o.EagerOpt = None,
    attention_backend: o.BackendOpt = None,
    cpu_linear: o.CpuLinearOpt = None,
    cpu_prefill_attention: o.CpuPrefillAttentionOpt = None,
    device: o.DeviceOpt = None,
    speculative_config: o.SpeculativeOpt = None,
    enable_prefix_caching: o.PrefixCachingOpt = True,
    kv_offloading_size: o.OffloadSizeOpt = None,
    kv_disk_cache_dir: o.DiskDirOpt = None,
    kv_disk_cache_size: o.DiskSizeOpt = 10.0,
    preemption_mode: o.PreemptionOpt = o.PreemptionMode.recompute,
    tp: o.TensorParallelOpt = 1,
    dp: o.DataParallelOpt = 1,
    pp: o.PipelineParallelOpt = 1,
    pp_layer_partition: o.PipelinePartitionOpt = None,
    enable_expert_parallel: o.ExpertParallelOpt = False,
    prefill_instances: o.PrefillInstancesOpt = 0,
    decode_instances: o.DecodeInstancesOpt = 0,
    prefill_tp: o.PrefillTensorParallelOpt = None,
    prefill_pp: o.PrefillPipelineParallelOpt = None,
    prefill_backlog: o.PrefillBacklogOpt = 64,
    max_local_prefill_tokens: o.LocalPrefillOpt = 0,
    decode_token_cost: o.DecodeTokenCostOpt = 0.0,
    verbose: o.VerboseOpt = False,
):
    """Generate completions for one prompt or a file of them.

    Exit codes: 0 every line succeeded; 1 some line failed (its error record names the line);
    2 the job could not start (bad flag, missing model or input file).
    """
    io = IOArgs(prompt, input, output, input_format.value, fail_fast, quiet, window, chat)
    sampling = dict(
        n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, max_tokens=max_tokens,
        min_tokens=min_tokens, stop=stop or [], stop_token_ids=stop_token_id or [], ignore_eos=ignore_eos,
        logprobs=logprobs, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
    )
    engine = o.engine_kwargs(
        dtype=dtype, block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, kv_cache_memory=kv_cache_memory, eager=eager,
        attention_backend=attention_backend, device=device, tensor_parallel_size=tp, data_parallel_size=dp,
        cpu_linear=cpu_linear, enable_expert_parallel=enable_expert_parallel, pipeline_parallel_size=pp,
        pp_layer_partition=pp_layer_partition, quantization=quantization,
        cpu_prefill_attention=cpu_prefill_attention,
    )
    engine.update(o.disagg_kwargs(prefill_instances=prefill_instances, decode_instances=decode_instances,
                                  prefill_tp=prefill_tp, prefill_pp=prefill_pp, prefill_backlog=prefill_backlog,
                                  max_local_prefill_tokens=max_local_prefill_tokens,
                                  decode_token_cost=decode_token_cost))
    engine.update(o.kv_kwargs(enable_prefix_caching=enable_prefix_caching, kv_offloading_size=kv_offloading_size,
                              kv_disk_cache_dir=kv_disk_cache_dir, kv_disk_cache_size=kv_disk_cache_size,
                              preemption_mode=preemption_mode))
    ranks = Ranks(tp, dp, int(os.environ.get("RANK", "0")), pp, prefill_instances, decode_instances, prefill_tp,
                  prefill_pp, decode_token_cost > 0)
    with interruptible():  # SIGINT and SIGTERM: one line, and the output's lock removed (cli/interrupts.py)
        try:
            if speculative_config is not None:
                engine["speculative_config"] = o.parse_speculative_config(speculative_config, model)
            check_disaggregation(engine)
            if ranks.world > 1:
                check_parallel_args(io, dp, bool(prefill_instances))
                if "RANK" not in os.environ:
                    # Before starting tp x dp x pp processes that would all fail.
                    check_model_splits(model, tp, dp, enable_expert_parallel, pp, pp_layer_partition)
                    if prefill_tp is not None or prefill_pp is not None:
                        check_model_splits(model, prefill_tp or tp, pp=prefill_pp or pp)
                from toolkit.parallel import maybe_relaunch

                relaunched = maybe_relaunch(ranks.world)  # outside torchrun: run this command as that many processes
                if relaunched is not None:
                    raise typer.Exit(relaunched)
            try:
                code = (run_prompt(io, model, sampling, engine, ranks) if prompt is not None
                        else run_file(io, model, sampling, engine, ranks))
            finally:
                if ranks.world > 1:
                    from toolkit.parallel import shutdown

                    shutdown()
        except KeyboardInterrupt as e:  # before run_file knew the input's size, or with a single PROMPT
            what = ("before the completion was printed" if prompt is not None
                    else "while starting, before any line ran; rerun the same command to start again")
            end_with(CliError(f"{describe(e)} {what}", code=exit_code(e)), ranks)
        except CliError as e:
            end_with(e, ranks)
    raise typer.Exit(code)


def end_with(error: CliError, ranks: Ranks) -> None:
    if not ranks.main:
        raise typer.Exit(error.code) from None  # every rank hits the same error: rank 0 says it
    exit_with(error)


def check_parallel_args(io: IOArgs, dp: int, disaggregated: bool = False) -> None:
    """Before relaunching: the mistakes every rank would otherwise report."""
    flag = "--prefill-instances/--decode-instances" if disaggregated else "--dp"
    if io.prompt is not None:
        if dp > 1 or disaggregated:
            raise CliError(f"{flag} splits an input file among instances: use --input FILE --output OUT "
                           "(a single PROMPT runs with --tp only)")
        return
    if io.input is None:
        raise CliError("give a PROMPT or --input FILE (see toolkit generate --help)")
    if not io.input.is_file():
        raise CliError(f"input file not found: {io.input}")
    if (dp > 1 or disaggregated) and io.output is None:
        raise CliError(f"{flag} writes one shard file per instance, merged at the end: give --output FILE")


def check_disaggregation(engine_args: dict) -> None:
    """The instance counts and what they do not combine with, before any process starts."""
    from toolkit.config import EngineConfig

    fields = {k: engine_args[k] for k in ("prefill_instances", "decode_instances", "prefill_tensor_parallel_size",
                                          "prefill_pipeline_parallel_size", "max_local_prefill_tokens",
                                          "decode_token_cost",
                                          "data_parallel_size", "pipeline_parallel_size", "speculative_config",
                                          "kv_offloading_size", "kv_disk_cache_dir", "enable_expert_parallel")
              if k in engine_args}
    if not fields.get("prefill_instances") and not fields.get("decode_instances") \
            and fields.get("prefill_tensor_parallel_size") is None \
            and fields.get("prefill_pipeline_parallel_size") is None and not fields.get("max_local_prefill_tokens") \
            and not fields.get("decode_token_cost"):
        return
    try:
        EngineConfig(model="-", **fields)
    except ValueError as e:
        names = {"prefill_instances": "--prefill-instances", "decode_instances": "--decode-instances",
                 "prefill_tensor_parallel_size": "--prefill-tp", "data_parallel_size": "--dp",
                 "prefill_pipeline_parallel_size": "--prefill-pp", "max_local_prefill_tokens": "--max-local-prefill-tokens",
                 "decode_token_cost": "--decode-token-cost",
                 "pipeline_parallel_size": "--pp", "speculative_config": "--speculative-config",
                 "kv_offloading_size": "--kv-offloading-size", "kv_disk_cache_dir": "--kv-disk-cache-dir",
                 "enable_expert_parallel": "--enable-expert-parallel"}
        message = str(e)
        for field_name, flag in names.items():
            message = message.replace(field_name, flag)
        raise CliError(message) from None


def check_model_splits(model: Path | None, tp: int, dp: int = 1, expert_parallel: bool = False, pp: int = 1,
                       pp_layer_partition: str | None = None) -> None:
    from toolkit.config import load_model_config
    from toolkit.parallel.dims import ParallelDims
    from toolkit.parallel.expert_parallel import num_experts

    path = resolve_model(model, lambda message: None)
    try:
        config = load_model_config(path)
        expert_parallel = expert_parallel and num_experts(config) is not None  # a dense model: the flag is ignored
        dims = ParallelDims(dp=dp, pp=pp, tp=tp, expert_parallel=expert_parallel, pp_layer_partition=pp_layer_partition)
        dims.validate(config, dims.world_size)  # what every rank would check after the relaunch, checked once here
    except (OSError, ValueError) as e:
        flags = f"--tp {tp} --dp {dp} --enable-expert-parallel" if expert_parallel else f"--tp {tp}"
        flags += f" --pp {pp}" if pp > 1 else ""
        raise CliError(f"{flags}: {e}") from None


def run_prompt(io: IOArgs, model: Path | None, sampling: dict, engine_args: dict, ranks: Ranks = Ranks()) -> int:
    if io.input is not None or io.output is not None:
        raise CliError("a PROMPT's completion is printed to stdout; --input and --output are for prompt files")
    from toolkit.backends import start_early

    console = stderr_console() if ranks.main else Console(quiet=True)
    base = base_params(sampling)
    start_early(engine_args.get("device"))  # a first run's kernel builds overlap reading the chat template too
    job = prompt_job(io, model, engine_args, base)
    # A PROMPT's run never holds more sequences than it asks for: its KV cache is sized for those, not
    # for max_num_seqs of them (allocating and zeroing the rest took longer than a short answer).
    sequences = len(job.prompts or [None]) * base.n
    engine_args = {**engine_args, "max_num_seqs": min(engine_args.get("max_num_seqs", sequences), sequences),
                   "enforce_eager": engine_args.get("enforce_eager", runs_eagerly(sequences * base.max_tokens))}
    engine = load_engine(model, with_workload(engine_args, model, [job]), console, io.quiet, text_from="a text PROMPT")

    def print_text(record: dict) -> None:
        if ranks.main:
            print_completions(record["outputs"], with_logprobs=base.logprobs is not None)

    reporter = Reporter(console, total=1, done=0, show_bar=False)
    runner = BatchRunner(engine, NativeRecords(), print_text, RunStats(), reporter, window=1, fail_fast=True)
    try:
        runner.run([job])
    except LineFailed as e:
        raise CliError(str(e).removeprefix("line 1: "), code=EXIT_LINE_FAILED) from None
    return 0


# A single PROMPT of at most this many new tokens (all its completions together) runs eagerly unless
# --compiled: up to about here the compiled step's load (or, on a first run, its compile) costs more than
# its faster steps save (docs/benchmarks.md measures both). Files and servers always compile.
EAGER_PROMPT_TOKENS = 512


def runs_eagerly(new_tokens: int) -> bool:
    """A PROMPT run's `enforce_eager` where neither --eager nor --compiled was given."""
    return new_tokens <= EAGER_PROMPT_TOKENS


def prompt_job(io: IOArgs, model: Path | None, engine_args: dict, params: SamplingParams) -> Job:
    """The PROMPT as a user message through the chat template (--chat, or by default where the model has
    one: an instruct model answers a question only in its chat format), else as text to complete."""
    from toolkit.tokenizer import has_chat_template

    chat = io.chat
    if chat is None:
        chat = has_chat_template(engine_args.get("tokenizer") or resolve_model(model, lambda message: None))
    if chat:
        return Job(line=1, id=1, kind="chat", messages=[{"role": "user", "content": io.prompt}], params=params)
    return Job(line=1, id=1, prompt=io.prompt, params=params)


def print_completions(completions: list[dict], with_logprobs: bool) -> None:
    """The text of each completion on stdout (under a header line when there are several) and, with
    --logprobs, one JSON line per generated token on stderr: {"completion", "position", "token_id",
    "logprobs"}, where "logprobs" is the entry the output records carry for that token."""
    for completion in completions:
        if len(completions) > 1:
            sys.stdout.write(f"--- completion {completion['index'] + 1} of {len(completions)} ---\n")
        sys.stdout.write(completion["text"] + "\n")
        sys.stdout.flush()
        if with_logprobs:
            for position, (token, entry) in enumerate(zip(completion["token_ids"], completion.get("logprobs") or [])):
                line = {"completion": completion["index"], "position": position, "token_id": token, "logprobs": entry}
                sys.stderr.write(json.dumps(line) + "\n")
            sys.stderr.flush()


def run_file(io: IOArgs, model: Path | None, sampling: dict, engine_args: dict, ranks: Ranks = Ranks()) -> int:
    if io.input is None:
        raise CliError("give a PROMPT or --input FILE (see toolkit generate --help)")
    if not io.input.is_file():
        raise CliError(f"input file not found: {io.input}")
    # Global rank 0 holds the output's lock for the whole job (the other ranks write only shards).
    try:
        with OutputLock(io.output if ranks.main else None) as lock:
            lock.take()
            return _run_file(io, model, sampling, engine_args, ranks)
    except KeyboardInterrupt as e:  # before _run_file had counted the input (it says how far, after)
        done = io.output.read_bytes().count(b"\n") if io.output is not None and io.output.is_file() else 0
        total = sum(1 for _ in iter_lines(io.input))
        raise CliError(_interrupted(e, io, ranks, done, total, RunStats()), code=exit_code(e)) from None


def _run_file(io: IOArgs, model: Path | None, sampling: dict, engine_args: dict, ranks: Ranks) -> int:
    console = stderr_console() if ranks.main else Console(quiet=True)
    base = base_params(sampling)
    fmt = detect_format(io.input) if io.input_format == "auto" else io.input_format
    run = fingerprint(model, engine_args, sampling)
    resume, total = Resume({}, 0, 0), 0
    if ranks.main:  # only rank 0 reads (and trims) the output; the other ranks get its answer below
        if ranks.shards > 1 or ranks.prefill:
            merge_shards(io.output)  # shards an interrupted --dp (or disaggregated) run left behind
        resume = resume_from(io.output) if io.output is not None else Resume({}, 0, 0)
        # Before the (slow) model load: a reused output path from another job fails at once.
        check_run_matches(resume.runs, run, io.output, model or "the built-in model")
        total = check_input_matches(io.input, fmt, resume.done, io.output, resume.input_shas)
        if total == 0 and ranks.world == 1:
            console.print(f"[yellow]warning:[/yellow] {io.input} has no prompts (blank lines are skipped): "
                          "nothing to do", soft_wrap=True)
            return 0
        if (resume.done or resume.torn_bytes) and not io.quiet:
            console.print(_resume_message(resume, total, io.output), soft_wrap=True)
        # A single process may stop here; ranks must all get to the engine (the others wait for rank 0 there).
        if len(resume.done) == total and ranks.world == 1:
            return EXIT_LINE_FAILED if resume.errors else 0
    stats = RunStats(skipped=len(resume.done), skipped_errors=resume.errors)
    try:
        return _generate_file(io, model, base, fmt, run, engine_args, ranks, console, resume, total, stats)
    except KeyboardInterrupt as e:  # loading, compiling or generating: say how far the output got
        raise CliError(_interrupted(e, io, ranks, len(resume.done), total, stats), code=exit_code(e)) from None


def _interrupted(error: KeyboardInterrupt, io: IOArgs, ranks: Ranks, done: int, total: int, stats: RunStats) -> str:
    """The one line an interrupted file run ends with (rank 0's; the other ranks print nothing)."""
    if ranks.shards > 1 or ranks.prefill:  # every writer's records this run are in its shard, flushed per record
        written = done + sum(p.read_bytes().count(b"\n") for p in existing_shards(io.output))
    else:
        written = done + stats.succeeded + stats.errors
    if io.output is None:
        return (f"{describe(error)}: {written} of {total} lines have records on stdout; give --output FILE to "
                "make a run resumable")
    return f"{describe(error)}: {written} of {total} lines have records in {io.output}; rerun the same command to resume"


def _generate_file(io: IOArgs, model: Path | None, base: SamplingParams, fmt: str, run: RunFingerprint,
                   engine_args: dict, ranks: Ranks, console, resume: Resume, total: int, stats: RunStats) -> int:
    share = ranks.line_share
    engine_args = with_workload(engine_args, model, read_jobs(io.input, fmt, base, resume.done, share))
    engine = load_engine(model, engine_args, console, io.quiet,
                         text_from=f"plain-text input {io.input}" if fmt == "text" else None)
    if ranks.world > 1:
        import torch.distributed as dist

        shared = [(resume.done, resume.errors, total)]
        dist.broadcast_object_list(shared, src=0)
        done, errors, total = shared[0]
        resume = Resume(done, errors, 0)
        stats.skipped, stats.skipped_errors = len(done), errors
    # The exit code describes the whole output file, so error records from an earlier run count.
    failed = EXIT_LINE_FAILED if resume.errors else 0
    # --dp: rank 0's bar counts every replica's records, read from their shards (cli/progress.py).
    follow = ShardCounter([shard_path(io.output, i, ranks.dp) for i in range(ranks.dp)]) if share else None
    records = OpenAIRecords(str(model or "toolkit-default"), engine.tokenizer) if fmt == "openai" else NativeRecords()
    records = Stamped(records, run)
    where = str(io.output) if io.output else "stdout"
    sharded = share is not None or bool(ranks.prefill)
    target = (shard_path(io.output, ranks.shard, ranks.shards) if sharded else io.output) if ranks.writer else None
    # Disaggregated: the decode instances write; rank 0 (a prefill rank) shows no bar, only the summary.
    # The bar stays up until every replica is done (the gather below), so its last count is the job's.
    with Reporter(console, total, len(resume.done), not io.quiet and ranks.main and not ranks.prefill,
                  follow) as reporter:
        with RecordWriter(target) as writer:
            write = writer.write if ranks.writer else (lambda record: None)
            runner = BatchRunner(engine, records, write, stats, reporter, io.window, io.fail_fast,
                                 write if ranks.writes_failures else (lambda record: None))
            try:
                runner.run(read_jobs(io.input, fmt, base, resume.done, share))
            except LineFailed as e:
                raise CliError(f"{e} (--fail-fast: stopped; fix the line and rerun with the same --output to "
                               "resume)", code=EXIT_LINE_FAILED) from None
        engine_stats = engine.stats()
        stats.spec = engine_stats.get("spec_decode")
        if "disaggregated" not in engine_stats:
            stats.kv = kv_summary(engine)
        elif engine_stats["disaggregated"]["role"] == "decode":
            # A decode instance's prefix cache sees none of the prompts: the prefill instances compute
            # them. What it received is the handoff (a serving prefill instance's sends would count it twice).
            kv = engine_stats["disaggregated"]["kv"]
            stats.handoff = {k: kv[k] for k in ("transfers", "bytes", "seconds_total")}
        stats.pipeline = engine.pipeline_stats()  # a collective over the replica's ranks
        # Also the barrier: once rank 0 has every writer's stats, every shard is complete and closed.
        parts = _gather_writers(engine, stats) if sharded else None
    if sharded:
        if not ranks.main:
            return 0
        merge_shards(io.output)
        stats = _combine(parts)
    if not ranks.main:
        return 0
    if io.quiet:
        console.print(summary_line(stats, where), soft_wrap=True)
    else:
        print_summary(stats, console, where)
    return EXIT_LINE_FAILED if stats.errors else failed


def read_jobs(path: Path, fmt: str, base: SamplingParams, done: dict, share: tuple[int, int] | None = None):
    """Jobs for the lines without a record yet, parsed lazily as the runner asks for them.
    `share` (replica, dp): only the lines whose number % dp == replica (data parallel)."""
    used = {job_id: line for line, job_id in done.items()} if fmt == "openai" else {}
    for line, raw in iter_lines(path):
        if line in done or (share is not None and line % share[1] != share[0]):
            continue
        if fmt == "openai":
            job = parse_request(line, raw, base)
            if job.error is None and job.id in used:  # OpenAI's Batch API refuses a repeated custom_id
                job = failed(line, job.id, f"custom_id {job.id!r} is already used by line {used[job.id]}")
            used.setdefault(job.id, line)
        elif fmt == "jsonl":
            job = jsonl_job(line, raw, base)
        else:
            job = text_job(line, raw, base)
        job.input_sha = input_sha(raw)
        yield with_line_seed(job, base)


def fingerprint(model: Path | None, engine_args: dict, sampling: dict) -> RunFingerprint:
    """What a resumed run must share with the one that wrote the output (cli/fingerprint.py)."""
    path = resolve_model(model, lambda message: None)  # load_engine resolves it again, and warns
    try:
        return run_fingerprint(path, engine_args["dtype"], sampling)
    except (OSError, ValueError) as e:
        raise CliError(f"cannot load model {path}: {e}") from None


def _gather_writers(engine, stats: RunStats) -> list[RunStats] | None:
    """Every shard writer's stats on rank 0 (None elsewhere): the data-parallel replicas', or the
    decode instances' once every one of them is done (toolkit/front_end.py)."""
    return engine.front.collect(engine, stats)


def _combine(parts: list[RunStats]) -> RunStats:
    """The replicas' stats as one run (rank 0's clock and skipped counts)."""
    total = parts[0]
    for other in parts[1:]:
        total.succeeded += other.succeeded
        total.errors += other.errors
        total.prompt_tokens += other.prompt_tokens
        total.output_tokens += other.output_tokens
        total.ttft.extend(other.ttft)
        total.tpot.extend(other.tpot)
        total.spec = combine_spec(total.spec, other.spec)
        total.kv = combine_kv(total.kv, other.kv)
        total.handoff = combine_handoff(total.handoff, other.handoff)
    return total


def base_params(sampling: dict) -> SamplingParams:
    try:
        return SamplingParams(**sampling)
    except ValueError as e:
        raise CliError(f"invalid sampling option: {e}") from None


def require_tokenizer(path: Path, engine_args: dict, what: str) -> None:
    """Text needs the model's tokenizer: say so before loading, not at the first prompt."""
    from toolkit.tokenizer import TOKENIZER_FILES, has_tokenizer

    folder = Path(engine_args.get("tokenizer") or path)
    if not has_tokenizer(folder):
        raise CliError(f"{what} needs the model's tokenizer, but {folder} has none of {', '.join(TOKENIZER_FILES)}; "
                       "add them, or give prompt_token_ids in a JSONL file")


def with_workload(engine_args: dict, model: Path | None, jobs) -> dict:
    """The engine's arguments with the run's longest request as max_request_tokens (cli/workload.py):
    its KV cache is sized for what this run's lines ask for, not for max_model_len requests."""
    from toolkit.backends import start_early
    from toolkit.cli.workload import longest_request
    from toolkit.tokenizer import load_tokenizer

    start_early(engine_args.get("device"))  # a first run's kernel builds overlap the tokenizer's
    try:
        tokenizer = load_tokenizer(engine_args.get("tokenizer") or resolve_model(model, lambda message: None),
                                   read_only=True)
    except (OSError, ValueError):  # load_engine says what is wrong with the model folder
        return engine_args
    longest = longest_request(jobs, tokenizer)
    return engine_args if longest is None else {**engine_args, "max_request_tokens": longest}


def load_engine(model: Path | None, engine_args: dict, console, quiet: bool, text_from: str | None = None):
    from toolkit.config import EngineConfig
    from toolkit.engine import Engine

    def note(message: str) -> None:  # which model a run without --model uses: information, not a warning
        console.print(message, style="dim", soft_wrap=True)

    path = resolve_model(model, note)
    if text_from is not None:
        require_tokenizer(path, engine_args, text_from)
    try:
        with console.status(f"loading {path}", spinner="dots") if not quiet else nullcontext():
            return Engine(EngineConfig(model=str(path), **engine_args))
    except (OSError, ValueError) as e:  # missing files, unsupported model, bad engine option: all fixable
        raise CliError(f"cannot load model {path}: {e}") from None


def _resume_message(resume: Resume, total: int, output: Path) -> str:
    torn = f"; cut a torn last line ({resume.torn_bytes} bytes) left by an interrupted run" if resume.torn_bytes else ""
    errors = f" ({resume.errors} of them errors)" if resume.errors else ""
    if len(resume.done) == total:
        return f"nothing to do: every line of the input has a record in {output}{errors}{torn}"
    return f"resuming {output}: {len(resume.done)} of {total} lines already have a record{errors}{torn}"

