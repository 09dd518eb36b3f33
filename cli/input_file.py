"""Reading the input file: its lines one at a time (never all at once), their count, and their format.

Lines are numbered from 1 as an editor shows them; blank lines are skipped but still counted, so
a line number always points at the same place in the file, in every run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

FORMATS = ("text", "jsonl", "openai")
# How many non-blank lines auto-detection looks at: enough to step over a few malformed ones.
_DETECT_LINES = 20
_OPENAI_KEYS = ("custom_id", "url", "body")


def iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes without the line ending) for every non-blank line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark from some editors
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield number, raw


def detect_format(path: Path) -> str:
    """'openai' or 'jsonl' when the first lines hold JSON objects (OpenAI Batch lines have
    custom_id/url/body), else 'text'. A .jsonl/.json file is JSON even when no line parses,
    so its lines become "invalid JSON" errors rather than prompts."""
    seen = 0
    for _, raw in iter_lines(path):
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            return "openai" if any(k in obj for k in _OPENAI_KEYS) else "jsonl"
        seen += 1
        if seen >= _DETECT_LINES:
            break
    return "jsonl" if path.suffix.lower() in (".jsonl", ".json") else "text"
