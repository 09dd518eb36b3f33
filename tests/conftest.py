"""Fixtures shared by several test files, and the hypothesis profile every test runs under."""

import os

import pytest
import torch

from tests.hypothesis_profiles import PROFILE, profile_violation  # registers and loads the profile


# The suite builds hundreds of short-lived engines over many tiny shapes and thread counts. A step saved
# ahead of time is compiled without Inductor's graph cache (torch's aot_compile bypasses it), so each new
# key would cost a cold compile where the JIT step finds the graph another test compiled: the suite runs
# the JIT step unless a test asks for the saved one (tests/toolkit/test_compiled_cache.py does). Set
# before any engine or subprocess reads it; a value already set wins.
os.environ.setdefault("TOOLKIT_COMPILE_CACHE", "0")


def pytest_report_header(config):
    return f"hypothesis profile: {PROFILE} (HYPOTHESIS_PROFILE; tests/hypothesis_profiles.py)"


# The suite's longest file by far (a compiled engine per family and dtype, cold in CI: docs/benchmarks.md).
# `make test` hands whole files to two workers in collection order, and in path order this one came near
# the end, where it could run alone while the other worker had nothing left.
RUN_FIRST = ("tests/toolkit/test_bf16_error.py",)


def pytest_collection_modifyitems(config, items):
    """CI must not depend on the draw: no test's own @settings may defeat the profile. The longest file
    is moved to the front (stable, so every worker collects the same order)."""
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in RUN_FIRST)
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
