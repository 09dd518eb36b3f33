"""Inductor's vector-ISA probes, remembered between processes.

Before Inductor builds or loads any C++ it works out which vector ISAs this CPU runs: for each one it
builds a test program (kept in its cache) and loads it in a child Python. The CPU backend's
`cpp.vec_isa_ok` skips the base check, but not the AVX-512 BF16 and AMX ones, so every start still
paid a few child Pythons, a few tenths of a second, before its first step (docs/benchmarks.md).

A probe that loaded its program is kept in `$TOOLKIT_CACHE/kernels/vec-isa-probes.json`, keyed by
this CPU's flags, torch's version and the program's path (Inductor names it by its source, its flags
and the compiler), and the next start skips that child. A failed probe is not kept, so it runs again.
"""

from __future__ import annotations

from toolkit.backends.cpu import choices

_MARK = "_toolkit_remembers"


class _ProbeFailed(Exception):
    pass


def remember() -> None:
    """Wrap Inductor's probe so that its successes are kept on disk; once per process. Where this torch
    has no such probe, nothing changes."""
    from torch._inductor import cpu_vec_isa

    probe = getattr(cpu_vec_isa.VecISA, "_probe_load", None)
    if probe is None or getattr(probe, _MARK, False):
        return

    def probe_load(self, output_path: str) -> bool:
        def run() -> dict:
            if not probe(self, output_path):
                raise _ProbeFailed  # not kept: choices.cached saves only what run returns
            return {"loads": True}

        try:
            return choices.cached("vec-isa-probes", choices.key("inductor vec ISA probe", output_path), run)[0]["loads"]
        except _ProbeFailed:
            return False

    setattr(probe_load, _MARK, True)
    cpu_vec_isa.VecISA._probe_load = probe_load
