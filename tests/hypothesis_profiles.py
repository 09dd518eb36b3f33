"""Hypothesis profiles, so that a green CI run is not partly luck.

- `ci` (the default, whatever $CI says): derandomized (each test draws the same examples on every run,
  seeded by the test's own code), a bounded example count, no deadline, and the reproduction blob
  printed on failure. A red run is then about the change, and a rerun reproduces it.
- `random` (`HYPOTHESIS_PROFILE=random`, `make test-random`): new examples on every run, ten times
  as many per test, failures saved under .hypothesis/ and replayed first next time. A developer runs
  it by hand to look for bugs; every failure it finds is pinned in its test as an `@example`.

A test that sets its own count writes `max_examples=examples(N)`: N under `ci` (capped at the profile's
bound), N x RANDOM_FACTOR under `random`. conftest.py refuses, at collection, a test whose own
@settings defeats the profile (profile_violation).
"""

from __future__ import annotations

import os

from hypothesis import settings

CI_MAX_EXAMPLES = 200
RANDOM_FACTOR = 10

settings.register_profile("ci", derandomize=True, database=None, max_examples=CI_MAX_EXAMPLES, deadline=None,
                          print_blob=True)
settings.register_profile("random", derandomize=False, max_examples=CI_MAX_EXAMPLES * RANDOM_FACTOR,
                          deadline=None, print_blob=True)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "random"):
    raise RuntimeError(f"HYPOTHESIS_PROFILE={PROFILE!r}: the test profiles are 'ci' (default) and 'random'")
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """A test's own example count under the active profile (see the module's docstring)."""
    return n * RANDOM_FACTOR if PROFILE == "random" else min(n, CI_MAX_EXAMPLES)


def profile_violation(own: settings) -> str | None:
    """Why a test's own @settings defeats the active profile, or None: it may lower its example count,
    never take back the profile's derandomization (nor, under ci, exceed its bound)."""
    active = settings.default
    if own.derandomize != active.derandomize:
        return f"its @settings sets derandomize={own.derandomize}, the {PROFILE!r} profile {active.derandomize}"
    if PROFILE == "ci" and own.max_examples > CI_MAX_EXAMPLES:
        return f"max_examples={own.max_examples} is over the ci bound {CI_MAX_EXAMPLES}: write examples(N)"
    return None
