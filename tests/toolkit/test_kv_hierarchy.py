"""The KV memory hierarchy end to end, against transformers on the same weights: prefix caching for
every family (with chunked prefill and preemption forced), the CPU tier's round trip, the disk tier
read by a second process, refused disk entries (corrupt, truncated, another model's), swap
preemption, and the tiers' bad inputs. Greedy float32 tokens must equal transformers' every time."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoints import FAMILIES, hf_greedy, write_checkpoint
from tests.toolkit.test_parity import BYTES_PER_TOKEN, count_preemptions, first_diff
from toolkit import LLM, SamplingParams

NEW_TOKENS = 10
ROOT = Path(__file__).resolve().parents[2]


def shared_prefix_waves(seed: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """Two waves over two 37-token prefixes: the second has new suffixes and one exact repeat."""
    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(3, 384, (37,), generator=g).tolist() for _ in range(2)]

    def suffix():
        return torch.randint(3, 384, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()

    first = [prefixes[i % 2] + suffix() for i in range(6)]
    second = [prefixes[i % 2] + suffix() for i in range(5)] + [list(first[1])]
    return first, second


def make(family: str, path, kv_blocks: int | None = None, **kwargs) -> LLM:
    if kv_blocks is not None:
        kwargs["kv_cache_memory_bytes"] = kv_blocks * 16 * BYTES_PER_TOKEN.get(family, 512)
    kwargs.setdefault("enforce_eager", True)
    return LLM(str(path), dtype="float32", max_model_len=128, block_size=16, **kwargs)


def generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)


def check_tokens(outs, expected, what: str) -> None:
    for i, (out, want) in enumerate(zip(outs, expected)):
        got = out.outputs[0].token_ids
        assert got == want, f"{what}: prompt {i} diverges at {first_diff(got, want)}"


def metric(llm: LLM, name: str, **labels) -> int:
    return sum(m.value for m in llm.get_metrics() if m.name == name and labels.items() <= m.labels.items())


def expected_cached(prompt: list[int], computed: list[list[int]]) -> int:
    """Whole blocks of the longest prefix shared with a sequence computed before, short of the last token."""
    shared = max(next((i for i, (a, b) in enumerate(zip(prompt, seq)) if a != b), min(len(prompt), len(seq)))
                 for seq in computed)
    return min(shared, len(prompt) - 1) // 16 * 16


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_waves(request, tmp_path_factory):
    family = request.param
    path = write_checkpoint(tmp_path_factory.mktemp(family), family, seed=1)
    first, second = shared_prefix_waves()
    return family, path, first, second, hf_greedy(path, first + second, NEW_TOKENS)


MODES = {"default": {}, "chunked_prefill": {"max_num_batched_tokens": 12}, "preemption": {"kv_blocks": 8}}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_prefix_caching_gives_transformers_tokens(family_waves, mode):
    family, path, first, second, expected = family_waves
    llm = make(family, path, **MODES[mode])
    seen = count_preemptions(llm)
    outs_1 = generate(llm, first)
    outs_2 = generate(llm, second)
    check_tokens(outs_1 + outs_2, expected, f"{family}/{mode}")
    assert metric(llm, "toolkit:prefix_cache_hits") > 0
    computed = [p + o.outputs[0].token_ids[:-1] for p, o in zip(first, outs_1)]
    for prompt, out in zip(second, outs_2):
        if mode == "default":  # everything fits: every computed block is still there
            assert out.num_cached_tokens == expected_cached(prompt, computed)
        else:
            assert out.num_cached_tokens % 16 == 0 and out.num_cached_tokens <= expected_cached(prompt, computed)
    if mode == "preemption":
        assert seen["count"] > 0
    off = make(family, path, enable_prefix_caching=False, **MODES[mode])
    check_tokens(generate(off, first) + generate(off, second), expected, f"{family}/{mode}, caching off")
    assert metric(off, "toolkit:prefix_cache_hits") == 0


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("llama3"), "llama3", seed=1)
    first, second = shared_prefix_waves(seed=5)
    return path, first, second, hf_greedy(path, first + second, NEW_TOKENS)


def test_compiled_step_with_prefix_hits(llama):
    path, first, second, expected = llama
    llm = make("llama3", path, enforce_eager=False)
    check_tokens(generate(llm, first) + generate(llm, second), expected, "compiled")
    assert metric(llm, "toolkit:prefix_cache_hits") > 0


def test_cpu_tier_brings_evicted_blocks_back(llama):
    path, first, second, expected = llama
    llm = make("llama3", path, kv_blocks=8, kv_offloading_size=0.01)
    outs = generate(llm, first) + generate(llm, second) + generate(llm, first)
    check_tokens(outs, expected + expected[:len(first)], "cpu tier")
    assert metric(llm, "toolkit:kv_transfer_bytes", direction="device_to_cpu") > 0
    assert metric(llm, "toolkit:prefix_cache_hits_tier", tier="cpu") > 0
    assert metric(llm, "toolkit:kv_transfer_bytes", direction="cpu_to_device") > 0


def test_swap_preemption_gives_the_same_tokens(llama):
    path, first, second, expected = llama
    llm = make("llama3", path, kv_blocks=6, kv_offloading_size=0.01, preemption_mode="swap",
               enable_prefix_caching=False)
    seen = count_preemptions(llm)
    check_tokens(generate(llm, first + second), expected, "swap")
    tiers = llm.engine.stats()["kv_tiers"]
    assert seen["count"] > 0 and tiers["swapped_in"] == tiers["swapped_out"] > 0


DISK_WRITER = """
import sys
from toolkit import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, block_size=16, enforce_eager=True,
          kv_disk_cache_dir=sys.argv[2])
prompts = [[int(t) for t in line.split()] for line in sys.argv[3].split(",")]
llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
print(llm.engine.stats()["kv_tiers"]["copied_blocks"]["device_to_disk"])
"""


def test_disk_tier_is_read_by_a_second_process_and_refuses_bad_entries(llama, tmp_path, caplog):
    path, first, second, expected = llama
    disk = tmp_path / "kv"
    arg = ",".join(" ".join(map(str, p)) for p in first)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", DISK_WRITER, str(path), str(disk), arg], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    written = int(done.stdout.split()[-1])
    (fingerprint,) = [d for d in disk.iterdir() if d.is_dir()]
    entries = sorted(fingerprint.glob("*.kv"))
    assert written > 0 and len(entries) == written

    reader = make("llama3", path, kv_disk_cache_dir=str(disk))
    check_tokens(generate(reader, first), expected[:len(first)], "disk tier, second process")
    hits = metric(reader, "toolkit:prefix_cache_hits_tier", tier="disk")
    assert hits > 0 and metric(reader, "toolkit:kv_transfer_failed_loads") == 0
    # Each engine's disk writes run on a background thread: they must have landed before the entries
    # are damaged below, or a late good write would replace a damaged entry (the test failed so once).
    reader.engine.kv_tiers.close()

    # Break every entry in a different way: each is refused, and the tokens are recomputed.
    other = write_checkpoint(tmp_path / "other", "llama3", seed=9)
    foreign_dir = tmp_path / "kv-other"
    done = subprocess.run([sys.executable, "-c", DISK_WRITER, str(other), str(foreign_dir), arg], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (foreign_fp,) = [d for d in foreign_dir.iterdir() if d.is_dir()]
    assert foreign_fp.name != fingerprint.name  # another model's entries live under another name
    pristine = {e: e.read_bytes() for e in entries}

    def flip(entry, data):
        data = bytearray(data)
        data[-7] ^= 0xFF  # one flipped byte in the payload
        return bytes(data)

    def foreign(entry, data):
        # Prompt blocks have the same names under both models (output blocks differ with the weights).
        other_entry = foreign_fp / entry.name
        return other_entry.read_bytes() if other_entry.exists() else data

    damages = {"checksum": flip, "truncated": lambda entry, data: data[: len(data) // 2], "fingerprint": foreign}
    for problem, damage in damages.items():
        for leftover in fingerprint.iterdir():  # refused entries were removed, recomputed ones written
            leftover.unlink()
        for entry, data in pristine.items():
            entry.write_bytes(damage(entry, data))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="toolkit"):
            fresh = make("llama3", path, kv_disk_cache_dir=str(disk))
            check_tokens(generate(fresh, first), expected[:len(first)], f"disk tier, {problem}")
        refused = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
        assert refused and all(problem in m for m in refused), refused
        assert metric(fresh, "toolkit:kv_transfer_failed_loads") >= len(refused)  # a block per request that read it
        if problem != "fingerprint":  # there only the prompt blocks were replaced; the rest are good
            assert metric(fresh, "toolkit:prefix_cache_hits_tier", tier="disk") == 0
        fresh.engine.kv_tiers.close()  # its recomputed blocks' writes land before the next damage


def test_a_tier_that_cannot_be_had_is_left_out_with_a_warning(llama, tmp_path, caplog):
    path, first, _, expected = llama
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        llm = make("llama3", path, kv_disk_cache_dir=str(blocker / "kv"), kv_offloading_size=10**6)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "without the disk tier" in messages and "without the CPU tier" in messages
    assert llm.engine.kv_tiers is None
    check_tokens(generate(llm, first), expected[:len(first)], "no tiers")


def test_a_full_disk_leaves_the_disk_tier_out(llama, tmp_path, caplog, monkeypatch):
    import shutil

    path, first, _, expected = llama
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr("toolkit.kv_hierarchy.shutil.disk_usage", lambda p: usage._replace(free=100))
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        llm = make("llama3", path, kv_disk_cache_dir=str(tmp_path / "kv"))
    assert "has no room for one block" in " ".join(r.getMessage() for r in caplog.records)
    assert llm.engine.kv_tiers is None
    check_tokens(generate(llm, first), expected[:len(first)], "full disk")


@pytest.mark.parametrize("kwargs,match", [
    (dict(preemption_mode="swap"), "kv_offloading_size"),
    (dict(preemption_mode="evict"), "preemption_mode"),
    (dict(kv_offloading_size=-1), "kv_offloading_size"),
    (dict(kv_disk_cache_size=0), "kv_disk_cache_size"),
    (dict(kv_offloading_backend="lmcache"), "kv_offloading_backend"),
    (dict(seed=2**64), "seed"),
])
def test_bad_hierarchy_configs_are_refused_before_loading(kwargs, match):
    from toolkit.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(model="/nonexistent", **kwargs)


def test_cache_salt_keeps_tenants_apart(llama):
    path, first, _, expected = llama
    llm = make("llama3", path)
    salted = [{"prompt_token_ids": p, "cache_salt": "tenant-a"} for p in first[:2]]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    llm.generate(salted, params, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": first[0], "cache_salt": "tenant-b"},
                          {"prompt_token_ids": first[0], "cache_salt": "tenant-a"}], params, use_tqdm=False)
    assert again[0].num_cached_tokens == 0 and again[1].num_cached_tokens == (len(first[0]) - 1) // 16 * 16
    assert [o.outputs[0].token_ids for o in again] == [expected[0]] * 2
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": first[0], "cache_salt": 3}], params, use_tqdm=False)
