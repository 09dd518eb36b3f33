"""Inductor's vector-ISA probes remembered on disk (toolkit/backends/cpu/vec_isa_probes.py): a probe
that loaded its program is not run again while the file holds it, on this CPU and torch; a failed one
runs every time; the wrapping happens once. The probe stands in for Inductor's child Python."""

import json

import pytest
from torch._inductor import cpu_vec_isa

from toolkit.backends.cpu import build, vec_isa_probes


@pytest.fixture
def probes(tmp_path, monkeypatch):
    """Inductor's probe replaced by one that loads every program but 'bad.so' and records each call."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    calls = []

    def probe(self, output_path):
        calls.append(output_path)
        return output_path != "bad.so"

    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", probe)
    vec_isa_probes.remember()
    return calls


def test_a_probe_that_loaded_is_not_run_again_and_a_failed_one_is(probes, tmp_path, monkeypatch):
    isa = cpu_vec_isa.VecAVX2()
    assert [isa._probe_load("good.so") for _ in range(3)] == [True] * 3
    assert probes == ["good.so"]  # read back from the file the next times, as a new process would
    assert len(json.loads((tmp_path / "kernels" / "vec-isa-probes.json").read_text())) == 1
    assert [isa._probe_load("bad.so") for _ in range(2)] == [False] * 2
    assert probes == ["good.so", "bad.so", "bad.so"]
    # Another CPU (or torch) probes again.
    monkeypatch.setattr(build, "cpu_flags", lambda: "another cpu")
    assert isa._probe_load("good.so") and probes[-1] == "good.so" and len(probes) == 4


def test_remembering_wraps_the_probe_once(probes):
    wrapped = cpu_vec_isa.VecISA._probe_load
    vec_isa_probes.remember()
    assert cpu_vec_isa.VecISA._probe_load is wrapped
    assert cpu_vec_isa.VecAVX2()._probe_load("good.so") and probes == ["good.so"]
