"""Before resuming: is the output file really from this input, model and settings? And how many
lines does the input have?

Resuming skips input lines by line number. If the output path is reused for a different input,
those numbers point at other prompts and lines would be skipped silently; comparing the ids and
the input fingerprints the output recorded with the same input lines catches that before any work
is done. Likewise a record made with another model or other sampling options would sit beside new
ones that differ (cli/fingerprint.py says which options count).

Records without fingerprints (written before they existed) are accepted: refusing them would
strand every output an earlier version wrote, and their ids are still checked.
"""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.cli.errors import CliError
from toolkit.cli.fingerprint import RunFingerprint, input_sha
from toolkit.cli.input_file import iter_lines

START_OVER = "pass a new --output, or delete {output} to start over"


def check_run_matches(runs: dict[tuple, int], run: RunFingerprint, output: Path, model: Path) -> None:
    """Raises CliError when a record of `output` was made with another model or sampling options."""
    for (model_sha, settings_sha), line in runs.items():
        if model_sha not in (None, run.model_sha):
            raise CliError(f"{output} was written with another model or --dtype (its record for line {line} "
                           f"does not match {model}); rerun with the model and --dtype it was written with, or "
                           + START_OVER.format(output=output))
        if settings_sha not in (None, run.settings_sha):
            raise CliError(f"{output} was written with other sampling options (its record for line {line} does "
                           "not match this run's --max-tokens, --temperature, --top-p, --top-k, --min-p, --seed, "
                           "-n, --stop, --stop-token-id, --ignore-eos, --min-tokens, --logprobs or penalties); rerun "
                           "with the options it was written with, or " + START_OVER.format(output=output))


def check_input_matches(input_path: Path, fmt: str, done: dict[int, object], output: Path | None,
                        input_shas: dict[int, str] | None = None) -> int:
    """The number of input lines; raises CliError when the output's records do not fit this input."""
    total = 0
    seen = 0
    for line, raw in iter_lines(input_path):
        total += 1
        if line not in done:
            continue
        seen += 1
        expected = _line_id(fmt, line, raw)
        if expected is not None and done[line] is not None and expected != done[line]:
            raise CliError(
                f"{output} was written for another input: its record for line {line} has id {done[line]!r}, "
                f"but line {line} of {input_path} has id {expected!r}; " + START_OVER.format(output=output))
        recorded = (input_shas or {}).get(line)
        if recorded is not None and recorded != input_sha(raw):
            raise CliError(
                f"{output} was written for another input: its record for line {line} was made from other text "
                f"than line {line} of {input_path}; " + START_OVER.format(output=output))
    if seen < len(done):
        extra = sorted(set(done) - {line for line, _ in iter_lines(input_path)})[:3]
        raise CliError(f"{output} has records for lines {extra} that {input_path} does not have "
                       "(it was written for another input); " + START_OVER.format(output=output))
    return total


def _line_id(fmt: str, line: int, raw: bytes):
    """The id a record for this line carries, or None when the line is too broken to say."""
    if fmt == "text":
        return line
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    if fmt == "openai":
        return obj.get("custom_id")
    job_id = obj.get("id", line)
    return job_id if isinstance(job_id, (str, int)) and not isinstance(job_id, bool) else line
