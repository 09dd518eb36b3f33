"""Which prefill chunks go to ATen's flash attention (toolkit/backends/cpu/attention_plan.py): the
crossover read off measured timings, the choice cached per machine and head shape, and the op's
flash_min handed to each step by its own shapes. That both paths give the same attention is
test_attention_kernel.py's; that an engine forced to flash gives transformers' tokens, test_engine.py's."""

import json

import pytest
import torch

from toolkit.backends.cpu import attention_plan, choices, kernels


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    assert kernels.load() == {}
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(attention_plan, "_FLASH_MIN", {})


def with_times(monkeypatch, tiles, flash):
    """_measure on timings it is handed per candidate chunk length: tiles(n), flash(n) seconds."""
    calls = []

    def fake_best_of_each(run, reps=5):
        n = attention_plan.CANDIDATE_TOKENS[len(calls)]
        calls.append(n)
        return tiles(n), flash(n)

    monkeypatch.setattr(choices, "best_of_each", fake_best_of_each)
    return attention_plan._measure(torch.float32, 4, 2, 64, 16)


def test_measuring_keeps_the_tiles_until_flash_wins_for_good(monkeypatch):
    assert with_times(monkeypatch, lambda n: 1.0, lambda n: 2.0) == 0  # flash never wins
    assert with_times(monkeypatch, lambda n: 2.0, lambda n: 1.0) == 8  # from the shortest chunk on
    assert with_times(monkeypatch, lambda n: n, lambda n: 20 + 0.3 * n) == 48  # 0.93 at 32 (in the margin), 0.72 at 48
    assert with_times(monkeypatch, lambda n: 1.0, lambda n: 0.95) == 0  # within the margin: the tiles stay
    # One reading handed to flash by noise (at 16) is not a crossover; the lasting one (64 on) is.
    assert with_times(monkeypatch, lambda n: 1.0, lambda n: 0.5 if n == 16 or n >= 64 else 2.0) == 64
    last = attention_plan.CANDIDATE_TOKENS[-1]
    assert with_times(monkeypatch, lambda n: 1.0, lambda n: 0.5 if n == last else 2.0) == last


def test_the_choice_is_cached_per_head_shape_and_handed_to_steps_of_that_shape(tmp_path, monkeypatch, caplog):
    measured = []
    monkeypatch.setattr(attention_plan, "_measure", lambda *shape: measured.append(shape) or 48)
    caplog.set_level("INFO", logger="toolkit")
    chosen = attention_plan.choose("auto", torch.bfloat16, 9, 3, 64, 16)
    # The compiled step's cache key holds this line: a choice read back must give the same one.
    assert chosen == "prefill attention: ATen's flash attention for chunks of 48+ tokens, the tiles below"
    assert attention_plan.choose("auto", torch.bfloat16, 9, 3, 64, 16) == chosen and len(measured) == 1
    assert ["measured", "cached"] == [r.getMessage().rsplit("(", 1)[1].rstrip(")") for r in caplog.records]
    attention_plan.choose("auto", torch.float32, 9, 3, 64, 16)  # another dtype: measured again
    assert len(measured) == 2
    (tmp_path / "kernels" / "attention-choices.json").write_text("{ damaged")
    attention_plan.choose("auto", torch.bfloat16, 9, 3, 64, 16)  # a damaged file: measured anew
    assert len(measured) == 3
    assert len(json.loads((tmp_path / "kernels" / "attention-choices.json").read_text())) == 1

    cache = torch.zeros(2, 4, 16, 3, 64, dtype=torch.bfloat16)
    assert attention_plan.flash_min_for(torch.zeros(5, 9, 64, dtype=torch.bfloat16), cache) == 48
    assert attention_plan.flash_min_for(torch.zeros(5, 9, 64), cache.float()) == 48  # float32 was measured too
    assert attention_plan.flash_min_for(torch.zeros(5, 6, 64, dtype=torch.bfloat16), cache[:, :, :, :2]) == 0
    attention_plan.choose("tiles", torch.bfloat16, 9, 3, 64, 16)
    assert attention_plan.flash_min_for(torch.zeros(5, 9, 64, dtype=torch.bfloat16), cache) == 0
    attention_plan.choose("flash", torch.bfloat16, 9, 3, 64, 16)
    assert attention_plan.flash_min_for(torch.zeros(5, 9, 64, dtype=torch.bfloat16), cache) == 2
    attention_plan.choose("auto", torch.float16, 9, 3, 64, 16)  # float16 keeps the tiles, unmeasured
    assert attention_plan.flash_min_for(torch.zeros(5, 9, 64, dtype=torch.float16), cache.half()) == 0
    assert len(measured) == 3
    with pytest.raises(ValueError, match="cpu_prefill_attention must be one of auto, flash, tiles"):
        attention_plan.choose("sdpa", torch.bfloat16, 9, 3, 64, 16)


def test_a_real_measurement_runs_both_paths_and_returns_a_candidate():
    """The measurement's own batches on the real op, both paths: a table or length it built wrong is
    refused by the op's checks (block ids, lengths), so this fails; which length wins is the host's."""
    flash_min = attention_plan._measure(torch.float32, 4, 2, 64, 16)
    assert flash_min in (0, *attention_plan.CANDIDATE_TOKENS)
