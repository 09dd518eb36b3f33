"""KV cache sizing (toolkit/kv_sizing.py) against numbers worked out by hand from the checkpoint's config,
and the engine that uses it: the cache it allocates, the share per process, and the run that cannot fit."""

from __future__ import annotations

import pytest

from tests.checkpoints import COMMON, write_checkpoint
from toolkit import LLM
from toolkit.config import EngineConfig
from toolkit.kv_sizing import KVSizing, check_fits, request_tokens

# The llama3 test checkpoint in float32: 2 layers x 2 kv heads x head_dim 16 (64 / 4 heads), a key
# and a value of 4 bytes each.
HEAD_DIM = COMMON["hidden_size"] // COMMON["num_attention_heads"]
BYTES_PER_TOKEN = 2 * COMMON["num_hidden_layers"] * COMMON["num_key_value_heads"] * HEAD_DIM * 4
assert BYTES_PER_TOKEN == 512


def test_sizing_arithmetic():
    s = KVSizing(bytes_per_token=512, block_size=16, max_num_seqs=8, request_tokens=40, processes=4)
    assert s.block_bytes == 8192
    assert s.request_blocks == 3  # 40 tokens: two full blocks and a part
    assert s.useful_blocks == 24
    assert s.min_bytes == 3 * 8192
    assert s.budget(10_000_000, 0.3) == 750_000  # 3,000,000 shared by 4
    assert s.num_blocks(750_000) == 24  # 91 blocks' worth, but 8 requests of 3 blocks use 24
    assert s.num_blocks(100_000) == 12  # the budget binds
    assert s.num_blocks(8191) == 0


def test_request_tokens_is_the_workloads_when_known():
    assert request_tokens(8192, None) == 8192
    assert request_tokens(8192, 300) == 300
    assert request_tokens(8192, 10_000) == 8192  # max_model_len still bounds every request
    assert request_tokens(8192, 300, lookahead=4) == 304


def test_check_fits_names_the_numbers_and_the_flags():
    gib = 2**30
    check_fits(gib, gib, 2, 4 * gib, 8192)  # exactly fits
    with pytest.raises(ValueError) as e:
        check_fits(gib, gib // 2, 4, 5 * gib, 8192)
    message = str(e.value)
    assert "needs at least 6.00 GiB" in message and "4 processes x (1.00 GiB of weights + 512.00 MiB" in message
    assert "8,192-token request" in message and "5.00 GiB available" in message
    assert "--max-model-len" in message and "--tp/--pp/--dp" in message


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_max_request_tokens_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="max_request_tokens must be an integer >= 1"):
        EngineConfig(model="-", max_request_tokens=bad)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama3", seed=3)


def _blocks(llm: LLM) -> int:
    return llm.engine.stats()["kv_cache"]["blocks"]


GiB = 2**30


@pytest.fixture
def host(monkeypatch):
    """A host with a fixed amount of available memory, as the runner sees it."""
    import toolkit.runner

    def set_available(nbytes: int) -> None:
        monkeypatch.setattr(toolkit.runner, "available_memory_bytes", lambda device: nbytes)

    return set_available


def test_engine_cache_is_what_max_num_seqs_requests_of_the_workloads_length_use(ckpt, host):
    host(64 * GiB)  # the fraction never binds: 0.3 of it is far more than the run can use
    llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=6,
              max_request_tokens=40)
    assert _blocks(llm) == 6 * 3  # 6 requests of ceil(40 / 16) blocks
    assert llm.engine.stats()["kv_cache"]["block_size"] == 16
    llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=6)
    assert _blocks(llm) == 6 * 32  # without a hint: max_model_len requests, 512 / 16 blocks each


def test_engine_splits_the_fraction_over_the_hosts_processes(ckpt, host, monkeypatch):
    host(40 * 2**20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # as torchrun sets it for 4 processes on this host
    llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_memory_fraction=0.5)
    # 0.5 x 40 MiB = 20 MiB over 4 processes: 5 MiB each, in blocks of 16 x 512 bytes.
    assert _blocks(llm) == (5 * 2**20) // (16 * BYTES_PER_TOKEN) == 640


def test_a_run_that_cannot_fit_fails_before_loading(ckpt, host, monkeypatch):
    import toolkit.runner

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(toolkit.runner, "load_model", no_load)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    # One 512-token request's KV is 512 x 512 bytes = 256 KiB; each process also holds every weight
    # (counted from the checkpoint's tensors, float32); 300 KiB cannot hold two of them.
    from safetensors.torch import load_file

    weights = 4 * sum(t.numel() for t in load_file(ckpt / "model.safetensors").values())
    need = 2 * (weights + 256 * 2**10)
    host(300 * 2**10)
    with pytest.raises(ValueError) as e:
        LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=512)
    assert str(e.value).startswith(
        f"this run needs at least {need / 2**20:.2f} MiB (2 processes x ({weights / 2**10:.2f} KiB of weights + "
        "256.00 KiB of KV cache for one 512-token request)) but the host has 300.00 KiB available: lower "
        "max_model_len (--max-model-len)")


def test_info_host_rows_per_layout(ckpt):
    """`toolkit info`'s host table (cli/host_plan.py) for --tp 2 --dp 2 and --pp 2, by hand: 4 or 2
    processes share 0.3 of 1 GiB; each holds 1/tp or 1/pp of the weights, and a cache of its own kv
    heads or layers (256 bytes a token), at most 8 requests of 100 tokens (7 blocks each)."""
    import torch

    from toolkit.cli.host_plan import host_row
    from toolkit.config import load_model_config

    config = load_model_config(ckpt)
    weights = config.num_parameters * 4
    row = host_row(config, torch.float32, tp=2, pp=1, dp=2, available=GiB, block_size=16, max_num_seqs=8,
                   max_model_len=512, max_request_tokens=100)
    assert (row.processes, row.weight_bytes_per_process) == (4, weights // 2)
    assert row.kv_bytes_per_process == 8 * 7 * 16 * 256  # 0.3 GiB / 4 is far more than 8 requests use
    assert row.total_bytes == 4 * (weights // 2 + 8 * 7 * 16 * 256) and row.fits
    row = host_row(config, torch.float32, tp=1, pp=2, dp=1, available=700 * 2**10, block_size=16, max_num_seqs=8,
                   max_model_len=512, max_request_tokens=None)
    assert row.kv_bytes_per_process == (int(700 * 2**10 * 0.3) // 2) // (16 * 256) * (16 * 256)  # the budget binds
    assert row.min_total_bytes == 2 * (weights // 2 + 32 * 16 * 256) and not row.fits  # one 512-token request


def test_info_shows_each_disaggregated_instance(ckpt):
    """`toolkit info --prefill-instances 1 --decode-instances 2 --prefill-tp 2`, by hand: 4 processes share
    0.3 of 1 GiB; a prefill rank holds half the weights and one of the 2 kv heads (256 bytes a token), a
    decode rank all of them (512 bytes); each caches at most 8 requests of 100 tokens (7 blocks each), so
    each instance holds 8 x 7 x 16 tokens. The CLI prints the same plan, and refuses half a layout."""
    import json

    import torch
    from typer.testing import CliRunner

    from toolkit.cli.host_plan import disaggregated_plan
    from toolkit.cli.main import app
    from toolkit.config import load_model_config

    config = load_model_config(ckpt)
    weights = config.num_parameters * 4
    plan = disaggregated_plan(config, torch.float32, prefill=1, decode=2, prefill_tp=2, decode_tp=1, block_size=16,
                              max_num_seqs=8, max_model_len=512, max_request_tokens=100, available=GiB)
    prefill, decode = plan["rows"]
    assert (prefill["role"], prefill["processes"], prefill["weight_bytes_per_process"]) == ("prefill", 2, weights // 2)
    assert (decode["role"], decode["processes"], decode["weight_bytes_per_process"]) == ("decode", 2, weights)
    assert prefill["kv_bytes_per_process"] == 8 * 7 * 16 * 256 and decode["kv_bytes_per_process"] == 8 * 7 * 16 * 512
    assert prefill["kv_tokens_per_instance"] == decode["kv_tokens_per_instance"] == 8 * 7 * 16
    assert plan["processes"] == 4 and plan["fits"]
    assert plan["total_bytes"] == 2 * (weights // 2 + 8 * 7 * 16 * 256) + 2 * (weights + 8 * 7 * 16 * 512)
    # The budget binds on a small host: 0.3 of 2 MiB over 4 processes.
    small = disaggregated_plan(config, torch.float32, prefill=1, decode=2, prefill_tp=2, decode_tp=1, block_size=16,
                               max_num_seqs=8, max_model_len=512, max_request_tokens=100, available=2 * 2**20)
    assert small["rows"][1]["kv_bytes_per_process"] == (int(2 * 2**20 * 0.3) // 4) // (16 * 512) * (16 * 512)
    runner = CliRunner()
    result = runner.invoke(app, ["info", str(ckpt), "--json", "--prefill-instances", "1", "--decode-instances", "2",
                                 "--prefill-tp", "2", "--max-num-seqs", "8", "--max-request-tokens", "100",
                                 "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)["disaggregated"]
    assert [(r["role"], r["instances"], r["tp"]) for r in shown["rows"]] == [("prefill", 1, 2), ("decode", 2, 1)]
    # A pipelined decode instance: each stage's process holds half the layers' weights and KV.
    assert config.num_layers % 2 == 0
    piped = disaggregated_plan(config, torch.float32, prefill=1, decode=1, prefill_tp=2, decode_tp=1, block_size=16,
                               max_num_seqs=8, max_model_len=512, max_request_tokens=100, available=GiB, decode_pp=2)
    decode = piped["rows"][1]
    assert (decode["pp"], decode["processes"], decode["weight_bytes_per_process"]) == (2, 2, weights // 2)
    assert decode["kv_bytes_per_process"] == 8 * 7 * 16 * 256 and piped["processes"] == 4
    result = runner.invoke(app, ["info", str(ckpt), "--json", "--prefill-instances", "1", "--decode-instances", "1",
                                 "--prefill-tp", "2", "--pp", "2", "--prefill-pp", "1", "--max-num-seqs", "8",
                                 "--max-request-tokens", "100", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)["disaggregated"]
    assert [(r["role"], r["tp"], r["pp"], r["processes"]) for r in shown["rows"]] == [("prefill", 2, 1, 2),
                                                                                      ("decode", 1, 2, 2)]
    result = runner.invoke(app, ["info", str(ckpt), "--json", "--prefill-instances", "1", "--decode-instances", "1",
                                 "--dp", "2", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)["disaggregated"]  # a decode instance of 2 replicas: 2 processes
    assert [(r["role"], r["instances"], r["processes"]) for r in shown["rows"]] == [("prefill", 1, 1), ("decode", 2, 2)]
    half = runner.invoke(app, ["info", str(ckpt), "--prefill-instances", "1"])
    assert half.exit_code == 2 and "go together" in half.output
