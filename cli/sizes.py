"""Byte sizes as people type them ("2GiB", "512MiB", "1.5GB", "1000000") and as tables print them."""

from __future__ import annotations

import re

# Single letters are binary, like `ls -h` and docker: what someone typing "16G" for a GPU means.
_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from "2GiB" / "512MiB" / "1.5GB" / "1000000"; ValueError says what is accepted."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}: give bytes or a number with a unit, e.g. 2GiB, 512MiB, 1.5GB")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"invalid size {text!r}: must be at least 1 byte")
    return size


def format_size(num_bytes: float) -> str:
    """Binary units with three significant digits: 1.50 GiB, 640 MiB, 12.0 KiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            value = num_bytes / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{num_bytes:.0f} B"


def format_count(n: int) -> str:
    """Counts for narrow table columns: exact below 10,000, else three significant digits (33.6M)."""
    if n < 10_000:
        return f"{n:,}"
    for unit, scale in (("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return str(n)
