"""CI runs hypothesis derandomized with a bounded count; `make test-random` runs the random profile."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hypothesis import settings

from tests.hypothesis_profiles import CI_MAX_EXAMPLES, PROFILE, RANDOM_FACTOR, examples, profile_violation

REPO = Path(__file__).resolve().parents[1]


def active_profile(**env: str) -> list[str]:
    """The profile tests/hypothesis_profiles.py loads in a fresh process under `env`."""
    code = ("import tests.hypothesis_profiles as p; from hypothesis import settings; s = settings.default; "
            "print(settings.get_current_profile_name(), s.derandomize, s.max_examples, s.deadline, s.print_blob, "
            "p.examples(60), p.examples(1000))")
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**clean, **env}, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def test_ci_profile_is_the_default_also_under_ci_and_derandomized():
    ci = ["ci", "True", str(CI_MAX_EXAMPLES), "None", "True", "60", str(CI_MAX_EXAMPLES)]
    assert active_profile() == ci
    assert active_profile(CI="true") == ci  # hypothesis's own "ci" profile is not the one loaded


def test_random_profile_draws_more_examples_and_is_not_derandomized():
    assert active_profile(HYPOTHESIS_PROFILE="random") == [
        "random", "False", str(CI_MAX_EXAMPLES * RANDOM_FACTOR), "None", "True", str(60 * RANDOM_FACTOR),
        str(1000 * RANDOM_FACTOR)]
    assert active_profile(CI="true", HYPOTHESIS_PROFILE="random")[0] == "random"


def test_a_tests_own_settings_may_lower_the_count_but_not_undo_the_profile():
    assert profile_violation(settings(max_examples=examples(50), deadline=None)) is None
    assert "derandomize" in profile_violation(settings(derandomize=not settings.default.derandomize))
    if PROFILE == "ci":
        assert "ci bound" in profile_violation(settings(max_examples=CI_MAX_EXAMPLES + 1))


def test_make_test_random_runs_every_test_file_that_uses_hypothesis():
    run = subprocess.run(["make", "-n", "test-random"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    command = next(line for line in run.stdout.splitlines() if "HYPOTHESIS_PROFILE=random" in line)
    listed = set(re.findall(r"tests/\S+\.py", command))
    given = re.compile(r"^from hypothesis import .*\bgiven\b", re.M)
    using = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if given.search(p.read_text())}
    assert len(using) >= 5 and using <= listed
