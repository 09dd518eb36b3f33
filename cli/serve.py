"""`toolkit serve [MODEL]`: an OpenAI-compatible HTTP server (toolkit/server/) over one engine.

With --tp/--pp/--dp > 1 the command runs itself as that many processes (as `toolkit generate`
does); global rank 0 serves HTTP and broadcasts each step's new requests and aborts to the others,
which run the same engine loop without a front end. With --dp rank 0 routes each request to the
replica with the least work, and gathers every replica's news after each step; with
--prefill-instances/--decode-instances every rank adds every request, the roles route it to its
instances, and rank 0 gathers the decode instances' news. SIGTERM or Ctrl-C stops it gracefully: no new
connections, in-flight requests get --shutdown-timeout seconds to finish, the rest are aborted, and
the command exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Annotated, Optional

import typer

from toolkit.cli import options as o
from toolkit.cli.errors import CliError, exit_with, stderr_console
from toolkit.cli.generate import Ranks, check_disaggregation, check_model_splits, load_engine
from toolkit.cli.interrupts import describe, interruptible

SERVER = "Server"
log = logging.getLogger("toolkit")


def serve(
    model_arg: Annotated[Optional[Path], typer.Argument(
        metavar="MODEL",
        show_default=False,
        help="Hugging Face model folder or GGUF file (or give --model). Default: the built-in model.")] = None,
    host: Annotated[str, typer.Option(
        rich_help_panel=SERVER, help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, rich_help_panel=SERVER, help="Port to listen on.")] = 8000,
    served_model_name: Annotated[Optional[str], typer.Option(
        rich_help_panel=SERVER, show_default=False,
        help="The model's name in the API (requests must name it or leave model out). Default: MODEL as given.")] = None,
    max_waiting: Annotated[int, typer.Option(
        min=1, rich_help_panel=SERVER,
        help="Sequences that may wait for a slot; a request beyond that gets 503 at once.")] = 1024,
    shutdown_timeout: Annotated[float, typer.Option(
        min=0, rich_help_panel=SERVER,
        help="On SIGTERM or Ctrl-C, seconds in-flight requests get to finish before they are aborted.")] = 30.0,
    model: o.ModelOpt = None,
    dtype: o.DtypeOpt = "auto",
    quantization: o.QuantizationOpt = None,
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
    pp: o.PipelineParallelOpt = 1,
    dp: o.DataParallelOpt = 1,
    prefill_instances: o.PrefillInstancesOpt = 0,
    decode_instances: o.DecodeInstancesOpt = 0,
    prefill_tp: o.PrefillTensorParallelOpt = None,
    prefill_pp: o.PrefillPipelineParallelOpt = None,
    prefill_backlog: o.PrefillBacklogOpt = 64,
    max_local_prefill_tokens: o.LocalPrefillOpt = 0,
    decode_token_cost: o.DecodeTokenCostOpt = 0.0,
    pp_layer_partition: o.PipelinePartitionOpt = None,
    enable_expert_parallel: o.ExpertParallelOpt = False,
    verbose: o.VerboseOpt = False,
):
    """Serve a model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models),
    plus /tokenize, /detokenize, /health and Prometheus /metrics.

    Exit codes: 0 stopped by SIGTERM or Ctrl-C; 1 the engine failed (the server stops); 2 could not
    start (bad flag, missing model, port in use).
    """
    if model_arg is not None and model is not None and model_arg != model:
        exit_with(CliError(f"two models given: {model_arg} and --model {model}; give one"))
    model = model_arg if model_arg is not None else model
    engine_args = o.engine_kwargs(
        dtype=dtype, block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, kv_cache_memory=kv_cache_memory, eager=eager,
        attention_backend=attention_backend, device=device, tensor_parallel_size=tp, cpu_linear=cpu_linear,
        enable_expert_parallel=enable_expert_parallel, pipeline_parallel_size=pp, pp_layer_partition=pp_layer_partition,
        data_parallel_size=dp, quantization=quantization,
        cpu_prefill_attention=cpu_prefill_attention)
    engine_args.update(o.kv_kwargs(enable_prefix_caching=enable_prefix_caching, kv_offloading_size=kv_offloading_size,
                                   kv_disk_cache_dir=kv_disk_cache_dir, kv_disk_cache_size=kv_disk_cache_size,
                                   preemption_mode=preemption_mode))
    engine_args.update(o.disagg_kwargs(prefill_instances=prefill_instances, decode_instances=decode_instances,
                                   prefill_tp=prefill_tp, prefill_pp=prefill_pp, prefill_backlog=prefill_backlog,
                                   max_local_prefill_tokens=max_local_prefill_tokens,
                                   decode_token_cost=decode_token_cost))
    ranks = Ranks(tp, dp, int(os.environ.get("RANK", "0")), pp, prefill_instances, decode_instances, prefill_tp,
                  prefill_pp, decode_token_cost > 0)
    world, rank = ranks.world, ranks.rank
    name = served_model_name or str(model or "toolkit-default")
    try:
        if speculative_config is not None:
            engine_args["speculative_config"] = o.parse_speculative_config(speculative_config, model)
        check_disaggregation(engine_args)
        if world > 1:
            if "RANK" not in os.environ:
                check_model_splits(model, tp, dp, enable_expert_parallel, pp, pp_layer_partition)
                if prefill_tp is not None or prefill_pp is not None:
                    check_model_splits(model, prefill_tp or tp, pp=prefill_pp or pp)
            from toolkit.parallel import maybe_relaunch

            code = maybe_relaunch(world)
            if code is not None:  # the launcher: a server stopped by a signal it passed on stopped as asked
                raise typer.Exit(0 if code in (128 + signal.SIGINT, 128 + signal.SIGTERM) else code)
        listener = _listen(host, port) if rank == 0 else None
        with interruptible():
            try:
                engine = load_engine(model, engine_args, stderr_console(), quiet=rank != 0)
                _warm_up(engine)
            except KeyboardInterrupt as e:
                stderr_console().print(f"{describe(e)} while loading the model: stopped", soft_wrap=True)
                raise typer.Exit(0) from None
        _run(engine, rank, world, listener, name, max_waiting, shutdown_timeout, verbose)
    except CliError as e:
        if rank != 0:
            raise typer.Exit(e.code) from None
        exit_with(e)
    raise typer.Exit(0)


def _warm_up(engine) -> None:
    """One short request through the engine before the server answers /health, on every rank alike:
    the compiled step's graphs (prefill, decode; the speculative step's) are built now rather than in
    the first clients' requests, which would otherwise wait for them (tens of seconds on 2 cores)."""
    from toolkit import SamplingParams

    prompt = [t % engine.model_config.vocab_size for t in range(1, 9)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max(1, min(12, engine.max_model_len - 8)))
    engine.add_request("toolkit-serve-warm-up", prompt, params)
    while engine.has_unfinished():
        engine.step()
    engine.reset_prefix_cache()  # the clients' cache starts empty


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the (slow) model load so a port in use fails at once."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(2048)
    except OSError as e:
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _run(engine, rank: int, world: int, listener, name: str, max_waiting: int, shutdown_timeout: float,
         verbose: bool) -> None:
    from toolkit.llm import generation_defaults
    from toolkit.server.engine_loop import EngineLoop, RankSync
    from toolkit.server.metrics import ServerMetrics

    sync = RankSync() if world > 1 else None
    metrics = ServerMetrics()
    loop = EngineLoop(engine, max_waiting, sync, on_finished=metrics.request_finished)
    try:
        if rank != 0:
            # Rank 0 decides when to stop (and tells this rank); the launcher passes every signal to all.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            loop.run()
            return
        _serve_http(engine, loop, listener, name, generation_defaults(engine.config), metrics, shutdown_timeout,
                    verbose)
    finally:
        if world > 1:
            from toolkit.parallel import shutdown

            shutdown()


def _serve_http(engine, loop, listener, name: str, defaults: dict, metrics, shutdown_timeout: float,
                verbose: bool) -> None:
    import uvicorn

    from toolkit.server.app import build_app
    from toolkit.server.protocol import Front

    app = build_app(loop, Front(engine, name, defaults), metrics)
    config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="off")
    server = _uvicorn_server(config)
    loop.on_failure = lambda: setattr(server, "should_exit", True)  # a dead engine: stop (a supervisor restarts)
    loop.start()
    host, port = listener.getsockname()[:2]
    stderr_console().print(f"serving {name} on http://{host}:{port} (OpenAI API under /v1); "
                           "SIGTERM or Ctrl-C stops it", soft_wrap=True, highlight=False)
    try:
        server.run(sockets=[listener])
    finally:
        loop.stop()  # what still runs is aborted; the other ranks are told to stop
    if loop.failure is not None:
        raise CliError(f"the engine failed, so the server stopped: {type(loop.failure).__name__}: {loop.failure}",
                       code=1)


def _uvicorn_server(config):
    """uvicorn's server, except that a SIGTERM or SIGINT it shut down for is not raised again after
    the shutdown (uvicorn re-raises it, which would end the process by the signal): stopping as
    asked is a clean exit."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(config)
