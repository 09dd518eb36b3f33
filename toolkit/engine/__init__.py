"""The engine: its core loop (core.py), how it is built (build.py), the output processor and stats."""

from toolkit.engine.core import Engine

__all__ = ["Engine"]
