"""Ctrl-C (SIGINT) and SIGTERM end `toolkit generate` with one line and the output's lock removed.

Python's default SIGINT handler raises KeyboardInterrupt, but only where SIGINT was not ignored when
the process started: a job started in the background by a script, or by a scheduler, inherits
SIG_IGN and could not be interrupted at all. SIGTERM's default action kills the process on the spot:
no message, and the lock file left behind. Inside `interruptible()` both raise `Interrupted`, a
KeyboardInterrupt, wherever the main thread is (loading the model, compiling, generating), so the
code that knows how far the run got says so, and `with` blocks (the output's lock) clean up on the
way out. A second signal while that happens ends the process at once.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_held: list[list[int]] = []  # one list per held() block open, of the signals that came inside it


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(error: KeyboardInterrupt) -> int:
    """128 + the signal's number, as a shell reports a process the signal killed (130 for Ctrl-C)."""
    return 128 + getattr(error, "signum", signal.SIGINT)


def describe(error: KeyboardInterrupt) -> str:
    """"interrupted" for Ctrl-C, "interrupted (SIGTERM)" for another signal."""
    signum = getattr(error, "signum", signal.SIGINT)
    return "interrupted" if signum == signal.SIGINT else f"interrupted ({signal.Signals(signum).name})"


@contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted in the main thread while inside (also where SIGINT was
    ignored at start); the previous handlers come back on the way out. Elsewhere than the main
    thread (signal handlers cannot be set there) it does nothing."""
    raised = []

    def handler(signum, frame):
        if raised:  # the first is being handled (cleanup, the message): a second one ends the process
            os._exit(128 + signum)
        raised.append(signum)
        if _held:  # inside held(): raised on the way out of it
            _held[-1].append(signum)
            return
        raise Interrupted(signum)

    try:
        previous = {s: signal.signal(s, handler) for s in SIGNALS}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)  # None: set outside Python


@contextmanager
def held() -> Iterator[None]:
    """A signal that comes inside (under `interruptible`) is raised on the way out, not in the middle:
    for a few steps that must happen together, such as taking the output's lock and handing it to the
    `with` that removes it. Python runs signal handlers in the main thread, whichever thread the OS
    gave the signal to, so this holds where masking the signal in one thread would not."""
    came: list[int] = []
    _held.append(came)
    try:
        yield
    finally:
        _held.remove(came)
    if came:
        raise Interrupted(came[0])
