"""Before resuming: is the output file really from this input? And how many lines does the input have?

Resuming skips input lines by line number. If the output path is reused for a different input,
those numbers point at other prompts and lines would be skipped silently; comparing the ids the
output recorded with the ids on the same input lines catches that before any work is done.
"""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.cli.errors import CliError
from toolkit.cli.input_file import iter_lines


def check_input_matches(input_path: Path, fmt: str, done: dict[int, object], output: Path | None) -> int:
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
                f"but line {line} of {input_path} has id {expected!r}; pass a new --output")
    if seen < len(done):
        extra = sorted(set(done) - {line for line, _ in iter_lines(input_path)})[:3]
        raise CliError(f"{output} has records for lines {extra} that {input_path} does not have "
                       "(it was written for another input); pass a new --output")
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
