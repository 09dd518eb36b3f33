"""Kernel choices measured at engine start and kept on disk: how two implementations are timed, where
one takes over from the other, and the file the result is kept in (`$TOOLKIT_CACHE/kernels/NAME.json`).

The linears (linear.py: panel kernel or oneDNN, by row count) and prefill attention (attention_plan.py:
the tiles or ATen's flash attention, by chunk length) are both chosen this way: which is faster depends
on the CPU, so the engine measures it once per machine and shape and reads it back at the next start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence

import torch

from toolkit.backends.cpu import build

log = logging.getLogger("toolkit")


def best_of_each(run, reps: int = 5) -> tuple[float, float]:
    """The fastest of `reps` timed calls of run(True) and of run(False), taken in turn so that the host's
    drift reaches both alike, after one untimed each (the first touches the data)."""
    run(True), run(False)
    best = [math.inf, math.inf]
    for _ in range(reps):
        for i, arg in enumerate((True, False)):
            start = time.perf_counter()
            run(arg)
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def first_lasting_win(wins: Sequence[bool]) -> int | None:
    """The index of the first win that the next reading confirms (or that is the last reading), None if
    none: a shared host's noise can hand one reading to either side, never two in a row."""
    for i in range(len(wins)):
        if wins[i] and (i + 1 == len(wins) or wins[i + 1]):
            return i
    return None


def first_lasting_win_measured(candidates: Sequence[int], timings: Callable[[int], tuple[float, float]],
                               margin: float, what: str) -> int | None:
    """Time both implementations at each candidate in turn (`timings(n)` -> (the incumbent's seconds,
    the challenger's)) until the challenger wins (by `margin`) twice in a row: past that the work only
    grows more compute-bound, where it keeps winning. Returns `first_lasting_win` of the readings."""
    wins = []
    for n in candidates:
        incumbent_s, challenger_s = timings(n)
        wins.append(challenger_s < margin * incumbent_s)
        log.debug("%s at %d: %.3f ms against %.3f ms", what, n, incumbent_s * 1e3, challenger_s * 1e3)
        if wins[-2:] == [True, True]:
            break
    return first_lasting_win(wins)


def crossover(candidates: Sequence[int], timings: Callable[[int], tuple[float, float]], margin: float, what: str,
              never: int) -> int:
    """The largest candidate row count up to which the panels are not beaten by oneDNN (by `margin`) at
    two candidates in a row, `timings(m)` giving (panel seconds, oneDNN seconds); 0 when oneDNN wins from
    the first candidate on, `never` when it never does."""
    i = first_lasting_win_measured(candidates, timings, margin, f"{what} (panel, oneDNN)")
    return never if i is None else 0 if i == 0 else candidates[i - 1]


def key(*parts: object) -> str:
    """A choice's key: the machine (CPU flags, torch, threads) and the caller's parts (what was measured,
    the candidates, the result's fields), so that any of them changed, the choice is measured again."""
    text = "\0".join([build.cpu_flags(), torch.__version__, str(torch.get_num_threads()), *map(str, parts)])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cached(name: str, choice_key: str, measure: Callable[[], dict]) -> tuple[dict, bool]:
    """The choice under `choice_key` in `$TOOLKIT_CACHE/kernels/<name>.json`, or `measure()`'s, saved
    there; returns (choice, whether it was read back)."""
    path = build.cache_dir() / f"{name}.json"
    found = _read(path).get(choice_key)
    if found is not None:
        return found, True
    choice = measure()
    choices = _read(path)
    choices[choice_key] = choice
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{time.monotonic_ns()}.tmp")
        tmp.write_text(json.dumps(choices, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:  # the choice still serves this process; the next start measures again
        log.warning("could not save the kernel choice to %s: %s", path, e)
    return choice, False


def _read(path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # none yet, or a damaged file: measure again
        return {}
