"""Fixtures shared by several test files, and the hypothesis profile every test runs under."""

import os

# Two pytest workers share two cores, each running engines with torch's two threads: OpenMP's default
# (active) waiting spins a thread at the end of every parallel region while its partner is descheduled,
# burning the core the other worker needs. Sleeping instead gives the same results bit for bit (the
# work is split the same way) in a fraction of the time (docs/benchmarks.md). Read when OpenMP starts,
# so set before torch is imported; subprocesses inherit it; a value already set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.hypothesis_profiles import PROFILE, profile_violation  # registers and loads the profile


# The suite builds hundreds of short-lived engines over many tiny shapes and thread counts. A step saved
# ahead of time is compiled without Inductor's graph cache (torch's aot_compile bypasses it), so each new
# key would cost a cold compile where the JIT step finds the graph another test compiled: the suite runs
# the JIT step unless a test asks for the saved one (tests/toolkit/test_compiled_cache.py does). Set
# before any engine or subprocess reads it; a value already set wins.
os.environ.setdefault("TOOLKIT_COMPILE_CACHE", "0")


def pytest_report_header(config):
    return f"hypothesis profile: {PROFILE} (HYPOTHESIS_PROFILE; tests/hypothesis_profiles.py)"


def pytest_collection_modifyitems(config, items):
    """CI must not depend on the draw: no test's own @settings may defeat the profile."""
    for item in items:
        own = getattr(getattr(item, "obj", None), "_hypothesis_internal_use_settings", None)
        why = profile_violation(own) if own is not None else None
        if why:
            raise pytest.UsageError(f"{item.nodeid}: {why} (tests/hypothesis_profiles.py)")


@pytest.fixture(scope="module")
def one_torch_thread():
    """In-process engine runs on a shared 2-core machine: two torch threads fighting other processes
    for the cores ran up to ~50x slower, so these modules run with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
