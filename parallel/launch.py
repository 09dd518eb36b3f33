"""Start a multi-process job without knowing torchrun: re-run this very command through it.

`toolkit generate --tp 2 ...` run from a shell is one process; it calls `maybe_relaunch(2)`, which
runs the same command line again as 2 processes through `torch.distributed.run` (the code behind
`torchrun`: elastic agent, `--standalone` rendezvous on a free local port) and waits for them. In
those children torchrun has set LOCAL_RANK/WORLD_SIZE, so `maybe_relaunch` returns None there and
the command goes on to do the work. Single node only: several nodes are started with torchrun on
each node (see recipes/run_multinode.sh).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger("toolkit")
# The pid of the process that ran relaunch(): a worker whose parent is no longer it was orphaned
# before it could ask to die with its parent (see die_with_parent).
LAUNCHER_PID_ENV = "TOOLKIT_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def launched_by_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def maybe_relaunch(nproc: int, argv: list[str] | None = None) -> int | None:
    """Exit code of the relaunched job; None when this process should do the work itself.

    None when one process is enough or when already inside a torchrun launch. The CLI does
    `code = maybe_relaunch(tp * dp); if code is not None: sys.exit(code)` before building the LLM.
    """
    if launched_by_torchrun():
        die_with_parent()
        return None
    if nproc <= 1:
        return None
    return relaunch(nproc, argv)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this worker when its launcher (torchrun's agent) dies.

    torchrun starts workers in their own sessions, so a `kill -9` of the launcher reaches none of
    them and they would go on (reparented to init) holding GPUs and writing shards. Linux only; the
    signal follows the thread that forked us, which for torchrun's agent is its main thread."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("could not ask to die with the launcher: %s", os.strerror(ctypes.get_errno()))
        return
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    expected = int(launcher) if launcher else None
    # The launcher may have died between our fork and the prctl: then no signal will ever come.
    # (Only checkable for our own relaunch: under a user's torchrun, pid 1 may be torchrun itself.)
    if expected is not None and os.getppid() != expected:
        os.kill(os.getpid(), signal.SIGKILL)


def relaunch(nproc: int, argv: list[str] | None = None) -> int:
    """Run `argv` (default: this process's command line) as nproc processes; their exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", *_this_program(argv)])
    log.info("relaunching as %d processes through torch.distributed.run", nproc)
    set_threads_per_process(nproc)
    for name in _SIGNAL_LOGGERS:  # the workers' own one line says what an interrupt left; not the agent's three
        logging.getLogger(name).addFilter(_not_about_a_signal)
    # The agent runs in this process, so it dies with it; the workers check they are its children.
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        run(args)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        log.error("the job failed: %s", ", ".join(f"rank {r} exit code {f.exitcode}" for r, f in e.failures.items()))
        return next((c for c in codes if c and c > 0), 1)
    except SignalException as e:
        # SIGINT/SIGTERM reached the agent, which passed it on to the workers and waited for them: they
        # have said what they got done (toolkit/cli/interrupts.py). Exit as the signal would have.
        return 128 + int(e.sigval)
    return 0


_SIGNAL_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


def _not_about_a_signal(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ("death signal, shutting down workers" in message or "closing signal" in message)


def set_threads_per_process(nproc: int) -> int:
    """OMP_NUM_THREADS for each of the nproc workers: this machine's cores shared out, unless the user
    set it. (torchrun would otherwise set 1, with a four-line banner on every launch.) Says so once."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // nproc)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    sys.stderr.write(f"note: {nproc} processes on {cores} cores: {threads} thread{'s' if threads > 1 else ''} each "
                     "(set OMP_NUM_THREADS to choose)\n")
    sys.stderr.flush()
    return threads


def _this_program(argv: list[str] | None) -> list[str]:
    """torchrun's program arguments: `argv` as given, or this process's own command line."""
    if argv is not None:
        return list(argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name != "__main__":
        # `python -m package.module`: run the module again, not its file (keeps package imports).
        return ["-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    if sys.argv[0] in ("-c", ""):
        raise RuntimeError("cannot relaunch `python -c ...`: start the job with torchrun instead")
    return list(sys.argv)
