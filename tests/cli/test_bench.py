"""`toolkit bench`: metric definitions, workloads, the report, and one tiny end-to-end run.

No test here times anything: performance is measured by the benchmark itself, never asserted.
Oracles: numpy for the summaries, hand-computed values for vLLM's metric definitions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from toolkit.cli.bench import bench_app
from toolkit.cli.bench.app import _merge_rounds
from toolkit.cli.bench.metrics import (
    RequestTiming, combine_throughput, decode_metrics, latency_metrics, summarize, throughput_metrics,
)
from toolkit.cli.bench.model import shape_config_only
from toolkit.cli.bench.pipeline import bubble_model
from toolkit.cli.bench.report import HIGHER, LOWER, build_rows, render_table, report_json
from toolkit.cli.bench.roofline import bandwidth_fraction, best_of_probes, compute_peak, decode_bytes_per_token, layer_linear_params, request_flops, shared_prefix_lens
from toolkit.cli.bench.systems import BenchError, HFSystem, OursSystem, VLLMSystem, no_progress, python_of
from toolkit.cli.bench.workload import (
    BenchRequest,
    hf_batches,
    load_dataset,
    multi_turn_workload,
    prefix_repetition_workload,
    random_workload,
    workload_summary,
    working_set_tokens,
)
from tests.checkpoints import VOCAB, write_checkpoint
from toolkit.config import load_model_config


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def timing(arrival, chunks, prompt_len=5):
    return RequestTiming(arrival, prompt_len, [(t, n) for t, n in chunks])


# --- metric definitions ------------------------------------------------------------------------


def test_ttft_tpot_itl_e2el_of_one_request():
    t = timing(10.0, [(10.5, 1), (10.7, 1), (11.0, 1), (11.6, 1)])
    assert t.ttft == pytest.approx(0.5)
    assert t.e2el == pytest.approx(1.6)
    assert t.output_len == 4
    # TPOT excludes the first token: (e2e - ttft) / (output tokens - 1).
    assert t.tpot == pytest.approx((1.6 - 0.5) / 3)
    assert t.itls == pytest.approx([0.2, 0.3, 0.6])


def test_multi_token_chunk_counts_tokens_for_tpot_and_one_gap_for_itl():
    # vLLM's bench serve: TPOT divides by tokens; ITL records one gap per streamed chunk.
    t = timing(0.0, [(1.0, 1), (2.0, 3), (2.5, 1)])
    assert t.output_len == 5
    assert t.tpot == pytest.approx((2.5 - 1.0) / 4)
    assert t.itls == pytest.approx([1.0, 0.5])


def test_one_token_request_has_ttft_but_no_tpot_or_itl():
    t = timing(0.0, [(0.3, 1)])
    assert t.ttft == pytest.approx(0.3) and t.e2el == pytest.approx(0.3)
    assert t.tpot is None and t.itls == []
    m = latency_metrics([t], duration_s=1.0)
    assert m["tpot_ms"] == {"mean": 0.0, "median": 0.0, "p99": 0.0}
    assert m["itl_ms"] == {"mean": 0.0, "median": 0.0, "p99": 0.0}
    assert m["ttft_ms"]["mean"] == pytest.approx(300.0)


def test_zero_chunk_adds_nothing():
    t = RequestTiming(0.0, 3)
    t.add(1.0, 0)
    t.add(2.0, 2)
    assert t.chunks == [(2.0, 2)]


def test_summaries_match_numpy():
    rng = np.random.default_rng(1)
    values = rng.exponential(0.05, 101).tolist()
    s = summarize(values)
    ms = np.asarray(values) * 1000
    assert s["mean"] == pytest.approx(ms.mean())
    assert s["median"] == pytest.approx(np.median(ms))
    assert s["p99"] == pytest.approx(np.percentile(ms, 99))
    assert summarize(values, percentiles=(50, 90))["p90"] == pytest.approx(np.percentile(ms, 90))
    assert summarize([]) == {"mean": 0.0, "median": 0.0, "p99": 0.0}


def test_latency_metrics_pool_itls_across_requests_and_average_tpot_per_request():
    rng = np.random.default_rng(2)
    timings = []
    for i in range(7):
        arrival = float(i)
        times = arrival + np.cumsum(rng.uniform(0.01, 0.2, rng.integers(1, 9)))
        timings.append(timing(arrival, [(float(x), 1) for x in times], prompt_len=10 + i))
    m = latency_metrics(timings, duration_s=20.0)
    ttfts = [t.chunks[0][0] - t.arrival for t in timings]
    tpots = [(t.chunks[-1][0] - t.chunks[0][0]) / (len(t.chunks) - 1) for t in timings if len(t.chunks) > 1]
    itls = [b[0] - a[0] for t in timings for a, b in zip(t.chunks, t.chunks[1:])]
    e2els = [t.chunks[-1][0] - t.arrival for t in timings]
    for key, values in (("ttft_ms", ttfts), ("tpot_ms", tpots), ("itl_ms", itls), ("e2el_ms", e2els)):
        ms = np.asarray(values) * 1000
        assert m[key]["mean"] == pytest.approx(ms.mean()), key
        assert m[key]["median"] == pytest.approx(np.median(ms)), key
        assert m[key]["p99"] == pytest.approx(np.percentile(ms, 99)), key
    out = sum(len(t.chunks) for t in timings)
    assert m["completed"] == 7 and m["output_tokens"] == out
    assert m["prompt_tokens"] == sum(10 + i for i in range(7))
    assert m["output_tokens_per_s"] == pytest.approx(out / 20.0)
    assert m["requests_per_s"] == pytest.approx(7 / 20.0)


def test_throughput_and_decode_metrics():
    m = throughput_metrics(8, 400, 200, 4.0)
    assert m["requests_per_s"] == 2.0 and m["output_tokens_per_s"] == 50.0 and m["total_tokens_per_s"] == 150.0
    d = decode_metrics(timing(0.0, [(0.5, 1)] + [(0.5 + 0.02 * k, 1) for k in range(1, 11)], prompt_len=32))
    assert d["decode_tokens_per_s"] == pytest.approx(50.0)
    assert d["tpot_ms"] == pytest.approx(20.0) and d["ttft_ms"] == pytest.approx(500.0)


def test_two_runs_combine_as_total_tokens_over_total_time():
    """--bracket: our runs before and after the peers count as one (rates from the totals, so a slow
    minute weighs by its length), with each run kept."""
    a, b = throughput_metrics(8, 400, 200, 4.0), throughput_metrics(8, 400, 200, 6.0)
    a["compile_in_run_s"], b["compile_in_run_s"] = 0.0, 0.5
    m = combine_throughput([a, b])
    assert m["output_tokens_per_s"] == pytest.approx(400 / 10.0) and m["requests_per_s"] == pytest.approx(16 / 10.0)
    assert m["total_tokens_per_s"] == pytest.approx(1200 / 10.0)
    assert m["num_requests"] == 8 and m["output_tokens"] == 200 and m["elapsed_s"] == pytest.approx(5.0)
    assert m["compile_in_run_s"] == 0.5 and m["runs"] == [a, b]
    fast = timing(0.0, [(0.5, 1)] + [(0.5 + 0.02 * k, 1) for k in range(1, 11)])  # 10 tokens in 0.2 s
    slow = timing(0.0, [(0.7, 1)] + [(0.7 + 0.03 * k, 1) for k in range(1, 11)])  # 10 tokens in 0.3 s
    d = decode_metrics([fast, slow])
    assert d["decode_tokens_per_s"] == pytest.approx(20 / 0.5) and d["ttft_ms"] == pytest.approx(600.0)
    assert d["runs_decode_tokens_per_s"] == pytest.approx([50.0, 100 / 3])
    assert d["output_tokens"] == 11


def test_two_latency_runs_pool_their_requests():
    first = [timing(0.0, [(0.1, 1), (0.2, 1)]), timing(0.0, [(0.3, 1), (0.4, 1)])]
    second = [timing(5.0, [(5.2, 1), (5.4, 1)])]
    res = {"latency": latency_metrics(first, 1.0), "decode_timing": first[0]}
    again = {"latency": latency_metrics(second, 2.0), "decode_timing": second[0]}
    _merge_rounds("latency", res, again, 4, ((first, 1.0), (second, 2.0)))
    lat = res["latency"]
    assert lat["completed"] == 3 and lat["duration_s"] == 3.0 and lat["concurrency"] == 4
    assert lat["ttft_ms"]["mean"] == pytest.approx(1000 * (0.1 + 0.3 + 0.2) / 3)
    assert [r["duration_s"] for r in lat["runs"]] == [1.0, 2.0]
    assert res["decode_timing"] == [first[0], second[0]]
    assert res["decode_bandwidth"] == [None, None]  # no probes beside these runs: no fraction beside them


def test_timing_json_round_trip():
    t = timing(1.5, [(2.0, 1), (2.5, 2)], prompt_len=9)
    back = RequestTiming.from_json(json.loads(json.dumps(t.to_json())))
    assert back == t


# --- workloads -----------------------------------------------------------------------------------


def test_random_workload_is_seeded_and_within_ranges():
    a = random_workload(50, (32, 256), (1, 7), vocab_size=1000, seed=3)
    b = random_workload(50, (32, 256), (1, 7), vocab_size=1000, seed=3)
    c = random_workload(50, (32, 256), (1, 7), vocab_size=1000, seed=4)
    assert a == b
    assert a != c
    assert len(a) == 50
    assert all(32 <= r.prompt_len <= 256 and 1 <= r.output_len <= 7 for r in a)
    assert all(3 <= t < 1000 for r in a for t in r.prompt_token_ids)
    # Both ends of an inclusive range are reachable.
    assert {r.output_len for r in a} == set(range(1, 8))
    fixed = random_workload(5, (4, 4), (9, 9), vocab_size=50, seed=0)
    assert all(r.prompt_len == 4 and r.output_len == 9 for r in fixed)


@pytest.mark.parametrize("bad", [dict(input_len=(5, 4)), dict(output_len=(0, 3)), dict(num_requests=0)])
def test_random_workload_rejects_bad_ranges(bad):
    args = dict(num_requests=3, input_len=(1, 4), output_len=(1, 4)) | bad
    with pytest.raises(ValueError):
        random_workload(args["num_requests"], args["input_len"], args["output_len"], vocab_size=100)


def test_dataset_lines_token_ids_text_and_errors(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_token_ids": [5, 6, 7], "max_tokens": 4}\n\n{"prompt": "ab c", "max_tokens": 2}\n'
                    '{"prompt_token_ids": [9]}\n')
    reqs = load_dataset(path, lambda text: [len(w) + 10 for w in text.split()], default_output_len=11)
    assert reqs == [BenchRequest([5, 6, 7], 4), BenchRequest([12, 11], 2), BenchRequest([9], 11)]
    assert len(load_dataset(path, lambda t: [1], 11, num_requests=2)) == 2
    with pytest.raises(ValueError, match="tokenizer"):
        load_dataset(path, None, 11)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"max_tokens": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_dataset(bad, None, 5)


def test_hf_batches_sort_by_output_then_prompt_length_and_cover_everything():
    reqs = random_workload(23, (1, 50), (1, 30), vocab_size=100, seed=5)
    batches = hf_batches(reqs, 4)
    assert [len(b) for b in batches] == [4] * 5 + [3]
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(23))
    keys = [(reqs[i].output_len, reqs[i].prompt_len) for i in flat]
    assert keys == sorted(keys)


def test_workload_summary():
    s = workload_summary([BenchRequest([1, 2], 3), BenchRequest([1, 2, 3, 4], 5)])
    assert s["prompt_tokens"] == 6 and s["output_tokens"] == 8
    assert s["prompt_len"] == {"min": 2, "mean": 3.0, "max": 4}


def test_prefix_repetition_shares_each_prefix_evenly_in_a_seeded_shuffle():
    reqs = prefix_repetition_workload(3, 10, 4, 5, num_requests=9, vocab_size=VOCAB, seed=1)
    assert reqs == prefix_repetition_workload(3, 10, 4, 5, num_requests=9, vocab_size=VOCAB, seed=1)
    assert all(r.prompt_len == 14 and r.output_len == 5 for r in reqs)
    prefixes = [tuple(r.prompt_token_ids[:10]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [3, 3, 3]
    assert working_set_tokens(reqs) == 3 * 10 + 9 * 4
    with pytest.raises(ValueError, match="num_prefixes"):
        prefix_repetition_workload(0, 10, 4, 5, num_requests=9, vocab_size=VOCAB)


def test_multi_turn_prompts_grow_by_a_turn_in_turn_major_order():
    reqs = multi_turn_workload(2, 3, user_len=4, reply_len=2, vocab_size=VOCAB, seed=0)
    assert [r.prompt_len for r in reqs] == [4, 4, 10, 10, 16, 16] and {r.output_len for r in reqs} == {2}
    for conv in (0, 1):
        turns = reqs[conv::2]
        for earlier, later in zip(turns, turns[1:]):  # the conversation so far, then a reply and a new message
            assert later.prompt_token_ids[: earlier.prompt_len] == earlier.prompt_token_ids
    assert working_set_tokens(reqs) == 2 * 16 and workload_summary(reqs)["distinct_prompt_tokens"] == 32


# --- roofline formulas and the benchmark model --------------------------------------------------


def test_125m_shape_config_and_counts_match_the_model(tmp_path, monkeypatch):
    """The shape's figures against the model transformers builds from it (on the meta device): its
    parameters, its decoder layers' linear weights, and the bytes a decode step reads."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TOOLKIT_BENCH_CACHE", str(tmp_path))
    mc = load_model_config(shape_config_only("125m"))
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads) == (768, 12, 12, 4)
    assert (mc.intermediate_size, mc.vocab_size, mc.max_position_embeddings) == (2048, 32000, 2048)
    assert not mc.tie_word_embeddings and mc.checkpoint_dtype == torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(mc.hf_config)
    assert mc.num_parameters == sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and ".layers." in name)
    assert layer_linear_params(mc) == linear
    embedding = model.get_input_embeddings().weight.numel()  # one row of it is read per token
    kv = sum(2 * m.k_proj.weight.shape[0] for m in model.modules() if hasattr(m, "k_proj")) * 2 * 100
    assert decode_bytes_per_token(mc, 2, 100) == pytest.approx((mc.num_parameters - embedding) * 2 + kv)
    # The useful-work definition (docs/benchmarks.md): P=3, O=2 feeds 4 tokens at contexts 1..4 and
    # samples 2, so the linears run 4 times, attention over 1+2+3+4 positions, the head twice.
    attention = 4 * mc.num_layers * mc.num_heads * mc.head_dim * (1 + 2 + 3 + 4)
    assert request_flops(mc, 3, 2) == pytest.approx(4 * 2 * linear + attention + 2 * 2 * embedding)
    # Positions 0 and 1 computed by an earlier request (a prefix-cache hit): contexts 3 and 4 remain.
    attention = 4 * mc.num_layers * mc.num_heads * mc.head_dim * (3 + 4)
    assert request_flops(mc, 3, 2, shared=2) == pytest.approx(2 * 2 * linear + attention + 2 * 2 * embedding)


def test_shared_prefixes_are_counted_once_in_the_useful_work():
    prompts = [[1, 2, 3, 4], [1, 2, 3, 9, 9], [1, 2, 3, 4], [5, 1, 2], [1, 2], [1, 7], []]
    # [1, 2, 3, 4] again: all but its last token were computed before; [1, 2] is a prefix of the first.
    assert shared_prefix_lens(prompts) == [0, 3, 3, 0, 1, 1, 0]


def test_moe_shape_counts_match_the_model(tmp_path, monkeypatch):
    """The MoE shape's total and per-token figures against transformers' own modules: a token is
    computed with the router and 2 of 16 experts per layer."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TOOLKIT_BENCH_CACHE", str(tmp_path))
    mc = load_model_config(shape_config_only("moe-0.5b"))
    assert mc.architecture == "Qwen3MoeForCausalLM" and (mc.moe.num_experts, mc.moe.top_k) == (16, 2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(mc.hf_config)
    assert mc.num_parameters == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    embedding = model.get_input_embeddings().weight.numel()
    assert 0.45e9 < mc.num_parameters < 0.55e9 and 0.09e9 < mc.num_active_parameters - embedding < 0.11e9
    assert mc.num_parameters - mc.num_active_parameters == experts * 14 // 16
    linear = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and ".layers." in name)
    router = sum(p.numel() for name, p in model.named_parameters() if name.endswith("mlp.gate.weight"))
    assert layer_linear_params(mc) == linear + router + experts * 2 // 16


def test_expert_load_rows_on_a_moe_model(tmp_path_factory, tmp_path):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=1)
    report = tmp_path / "report.json"
    result = bench("throughput", "--model", ckpt, "--num-requests", 3, "--input-len", 4, 9, "--output-len", 2, 5,
                   "--decode-tokens", 0, "--json", report, *QUICK)
    assert result.exit_code == 0, result.output
    assert "busiest expert's load / mean" in result.output
    ours = json.loads(report.read_text())["systems"]["toolkit (eager)"]
    experts = ours["experts"]["throughput"]
    # Every token fed (prompt and all but the last output token), times top-2, in each of the 3 layers.
    fed = sum(r.prompt_len + r.output_len - 1 for r in random_workload(3, (4, 9), (2, 5), VOCAB, seed=0))
    runs = len(ours["throughput"].get("runs", [None]))  # one timed run without a peer to bracket
    assert [sum(layer) for layer in experts["tokens"]] == [2 * fed * runs] * 3
    assert 1.0 <= experts["max_over_mean_worst"] <= 8 and experts["max_over_mean_mean"] <= experts["max_over_mean_worst"]


# --- the report ----------------------------------------------------------------------------------


def fake_systems():
    return {
        "toolkit (compiled)": {"throughput": {"output_tokens_per_s": 300.0, "total_tokens_per_s": 600.0,
                                              "requests_per_s": 2.0, "elapsed_s": 10.0},
                               "startup": {"total_s": 30.0, "load_s": 1.0, "compile_s": 25.0},
                               "decode": {"decode_tokens_per_s": 40.0, "bandwidth_fraction_pct": 30.0}},
        "transformers": {"throughput": {"output_tokens_per_s": 100.0, "total_tokens_per_s": 250.0,
                                        "requests_per_s": 0.5, "elapsed_s": 40.0},
                         "startup": {"total_s": 3.0, "load_s": 2.0},
                         "decode": {"decode_tokens_per_s": 20.0, "bandwidth_fraction_pct": 15.0}},
    }


def test_rows_hold_every_systems_values_and_our_ratio_to_each_peer():
    rows = build_rows("throughput", fake_systems(), ["toolkit (compiled)"], ["transformers"])
    by = {(r.section, r.metric): r for r in rows}
    out = by[("throughput", "output tokens/s")]
    assert out.values == {"toolkit (compiled)": 300.0, "transformers": 100.0}
    assert out.ratios == {"toolkit (compiled) / transformers": pytest.approx(3.0)}
    assert out.better == HIGHER
    startup = by[("start-up", "start-up (construct + warm-up)")]
    assert startup.better == LOWER and startup.ratios["toolkit (compiled) / transformers"] == pytest.approx(10.0)
    # A figure only one system has gets no ratio; a figure no system has gets no row.
    assert by[("start-up", "compile")].ratios["toolkit (compiled) / transformers"] is None
    assert ("roofline", "useful compute") not in by
    assert [r.section for r in rows][0] == "throughput"


def test_latency_rows_and_rendered_table():
    systems = {"ours": {"latency": {k: {"mean": 2.0, "median": 1.0, "p99": 5.0} for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")}},
               "peer": {"latency": {k: {"mean": 4.0, "median": 4.0, "p99": 4.0} for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")}}}
    rows = build_rows("latency", systems, ["ours"], ["peer"])
    metrics = [r.metric for r in rows]
    for name in ("TTFT", "TPOT", "ITL", "E2EL"):
        assert [f"{name} mean", f"{name} median", f"{name} p99"] == [m for m in metrics if m.startswith(name + " ")]
    ttft_p99 = next(r for r in rows if r.metric == "TTFT p99")
    assert ttft_p99.ratios["ours / peer"] == pytest.approx(1.25) and ttft_p99.better == LOWER
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render_table(rows, "t", "caption here"))
    text = console.export_text()
    assert "TTFT p99" in text and "ours / peer" in text and "1.25x" in text and "caption here" in text


def test_report_json_keys():
    rows = build_rows("throughput", fake_systems(), ["toolkit (compiled)"], ["transformers"])
    doc = json.loads(json.dumps(report_json("throughput", rows, machine={"cpu": "x"}, systems=fake_systems())))
    assert set(doc) == {"command", "machine", "systems", "rows"}
    assert set(doc["rows"][0]) == {"section", "metric", "unit", "better", "values", "ratios"}


# --- the vLLM subprocess protocol, with a stand-in worker -------------------------------------


def fake_worker(tmp_path, body: str) -> Path:
    script = tmp_path / "fake_worker.py"
    script.write_text(body)
    return script


def test_vllm_worker_protocol_progress_and_result(tmp_path, monkeypatch):
    body = (
        "import json, sys\n"
        "spec = json.load(open(sys.argv[1]))\n"
        "assert spec['requests'][0]['output_len'] == 3 and spec['warm']['output_len'] == 2\n"
        "print('vllm chatter on stdout')\n"
        "print(json.dumps({'event': 'phase', 'name': 'latency', 'total': 1}))\n"
        "print(json.dumps({'event': 'advance', 'n': 1}))\n"
        "t = {'arrival': 0.0, 'prompt_len': 2, 'chunks': [[0.5, 1], [0.6, 2]]}\n"
        "print(json.dumps({'event': 'result', 'result': {'version': 'x', 'startup': {'total_s': 1.0},"
        " 'latency': {'timings': [t], 'duration_s': 1.0}, 'decode': t}}))\n"
    )
    monkeypatch.setattr("toolkit.cli.bench.systems.WORKER", fake_worker(tmp_path, body))
    seen = []

    def phase(name, total):
        seen.append((name, total))
        return lambda n=1: seen.append(n)

    system = VLLMSystem(tmp_path, python=Path(sys.executable), dtype="bfloat16", eager=False, max_model_len=64,
                        max_num_seqs=8, max_num_batched_tokens=64)
    req = BenchRequest([5, 6], 3)
    out = system.run(mode="latency", requests=[req], warm=BenchRequest([5, 6], 2), concurrency=1, decode=req, phase=phase)
    assert seen == [("vLLM: latency", 1), 1]
    assert out["latency"]["timings"][0].output_len == 3 and out["decode"].tpot == pytest.approx(0.1 / 2)


def test_vllm_worker_waits_while_we_probe_beside_its_decode_run(tmp_path, monkeypatch):
    # The worker goes on only after a line on stdin, and reports what it saw between the two waits.
    body = (
        "import json, sys\n"
        "def wait():\n"
        "    print(json.dumps({'event': 'probe'}), flush=True)\n"
        "    if sys.stdin.readline() != '\\n':\n"
        "        sys.exit(4)\n"
        "spec = json.load(open(sys.argv[1]))\n"
        "assert spec['wait_for_probes'] is True\n"
        "wait()\n"
        "t = {'arrival': 0.0, 'prompt_len': 2, 'chunks': [[0.5, 1], [0.6, 2]]}\n"
        "wait()\n"
        "print(json.dumps({'event': 'result', 'result': {'version': 'x', 'startup': {'total_s': 1.0},"
        " 'throughput': {}, 'decode': t}}))\n"
    )
    monkeypatch.setattr("toolkit.cli.bench.systems.WORKER", fake_worker(tmp_path, body))
    readings = iter([{"bytes": 8, "read_bytes_per_s": 20e9}, {"bytes": 8, "read_bytes_per_s": 23e9}])
    calls = []
    probe = lambda: calls.append(1) or next(readings)  # noqa: E731
    system = VLLMSystem(tmp_path, python=Path(sys.executable), dtype="bfloat16", eager=False, max_model_len=64,
                        max_num_seqs=8, max_num_batched_tokens=64)
    req = BenchRequest([5, 6], 3)
    out = system.run(mode="throughput", requests=[req], warm=BenchRequest([5, 6], 2), concurrency=0, decode=req,
                     phase=lambda name, total: (lambda n=1: None), probe=probe)
    assert len(calls) == 2
    assert out["decode_bandwidth"]["read_bytes_per_s"] == 23e9
    assert out["decode_bandwidth"]["read_bytes_per_s_samples"] == [20e9, 23e9]


def test_vllm_worker_failure_reports_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr("toolkit.cli.bench.systems.WORKER", fake_worker(tmp_path, "import sys\nsys.stderr.write('no vllm here')\nsys.exit(3)\n"))
    system = VLLMSystem(tmp_path, python=Path(sys.executable), dtype="bfloat16", eager=False, max_model_len=64,
                        max_num_seqs=8, max_num_batched_tokens=64)
    with pytest.raises(BenchError, match="status 3(.|\n)*no vllm here"):
        system.run(mode="throughput", requests=[BenchRequest([1], 1)], warm=BenchRequest([1], 2), concurrency=0,
                   decode=None, phase=lambda name, total: (lambda n=1: None))
    assert python_of(tmp_path) == tmp_path / "bin" / "python"


# --- end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("bench"), "llama3", seed=1)


QUICK = ["--eager", "--dtype", "float32", "--peak-matmul-size", "64", "--bandwidth-mib", "4", "--no-progress"]


def bench(*args):
    return CliRunner().invoke(bench_app, [str(a) for a in args], catch_exceptions=False)


def test_throughput_end_to_end_with_hf_peer(tiny, tmp_path):
    report = tmp_path / "report.json"
    result = bench("throughput", "--model", tiny, "--num-requests", 3, "--input-len", 4, 9, "--output-len", 2, 5, "--seed", 7,
                   "--peer", "hf", "--hf-batch-size", 2, "--decode-tokens", 4, "--json", report, *QUICK)
    assert result.exit_code == 0, result.output
    assert "toolkit (eager) / transformers" in result.output and "output tokens/s" in result.output
    doc = json.loads(report.read_text())
    assert {"command", "machine", "roofline", "model", "workload", "settings", "systems", "rows"} <= set(doc)
    assert doc["machine"]["torch"] == torch.__version__ and doc["machine"]["cpu"]
    workload = random_workload(3, (4, 9), (2, 5), VOCAB, seed=7)
    want_out = sum(r.output_len for r in workload)
    ours, hf = doc["systems"]["toolkit (eager)"], doc["systems"]["transformers"]
    # --bracket (on with a peer): ours was timed before and after transformers, same workload both times.
    assert doc["settings"]["bracket"] is True and "before and after the peers" in result.output
    assert [run["output_tokens"] for run in ours["throughput"]["runs"]] == [want_out, want_out]
    assert len(ours["decode"]["runs_decode_tokens_per_s"]) == 2 and "runs" not in hf["throughput"]
    # Both systems are credited with exactly the requested tokens; transformers' batch waste is separate.
    assert ours["throughput"]["output_tokens"] == hf["throughput"]["output_tokens"] == want_out
    assert hf["throughput"]["generated_tokens"] >= want_out
    assert ours["decode"]["output_tokens"] == hf["decode"]["output_tokens"] == 4
    # Each decode run (ours twice, bracketed) is also held to the bandwidth probed just beside it.
    beside = [b["read_bytes_per_s"] for b in ours["decode"]["bandwidth_beside"]]
    assert len(beside) == 2 and all(len(b["samples"]) == 2 for b in ours["decode"]["bandwidth_beside"])
    tokens_s = [(4 - 1) / rate for rate in ours["decode"]["runs_decode_tokens_per_s"]]  # seconds of each run
    bound_s = sum(3 * ours["decode"]["bytes_per_token"] / b for b in beside)
    assert ours["decode"]["bandwidth_fraction_beside_pct"] == pytest.approx(100 * bound_s / sum(tokens_s))
    whole = doc["roofline"]["bandwidth"]["read_bytes_per_s"]
    assert len(doc["roofline"]["bandwidth"]["read_bytes_per_s_samples"]) == 2 + 2 * 2 + 2  # start, end, beside each run
    assert whole >= max(beside) and ours["decode"]["bandwidth_fraction_beside_pct"] >= ours["decode"]["bandwidth_fraction_pct"]
    assert ours["decode"]["bandwidth_fraction_pct"] == pytest.approx(
        100 * ours["decode"]["bytes_per_token"] * ours["decode"]["decode_tokens_per_s"] / whole)
    assert len(hf["decode"]["bandwidth_beside"]) == 1 and hf["decode"]["bandwidth_fraction_beside_pct"] > 0
    assert ours["roofline"]["useful_flops"] == hf["roofline"]["useful_flops"] > 0
    row = next(r for r in doc["rows"] if r["metric"] == "output tokens/s")
    assert row["ratios"]["toolkit (eager) / transformers"] == pytest.approx(
        row["values"]["toolkit (eager)"] / row["values"]["transformers"])


def test_latency_end_to_end(tiny, tmp_path):
    report = tmp_path / "lat.json"
    result = bench("latency", "--model", tiny, "--num-requests", 3, "--input-len", 4, 6, "--output-len", 2, 4, "-c", 2,
                   "--decode-tokens", 0, "--json", report, *QUICK)
    assert result.exit_code == 0, result.output
    lat = json.loads(report.read_text())["systems"]["toolkit (eager)"]["latency"]
    assert lat["completed"] == 3 and lat["concurrency"] == 2
    assert lat["output_tokens"] == sum(r.output_len for r in random_workload(3, (4, 6), (2, 4), VOCAB, seed=0))
    assert lat["ttft_ms"]["mean"] > 0 and lat["e2el_ms"]["p99"] >= lat["ttft_ms"]["p99"]


def test_latency_with_a_peer_brackets_our_runs(tiny, tmp_path):
    report = tmp_path / "lat.json"
    result = bench("latency", "--model", tiny, "--num-requests", 3, "--input-len", 4, 6, "--output-len", 2, 4, "-c", 2,
                   "--peer", "hf", "--decode-tokens", 3, "--json", report, *QUICK)
    assert result.exit_code == 0, result.output
    doc = json.loads(report.read_text())
    lat = doc["systems"]["toolkit (eager)"]["latency"]
    want = sum(r.output_len for r in random_workload(3, (4, 6), (2, 4), VOCAB, seed=0))
    assert lat["completed"] == 6 and lat["output_tokens"] == 2 * want  # both runs' requests, pooled
    assert [run["output_tokens_per_s"] > 0 for run in lat["runs"]] == [True, True]
    assert doc["systems"]["transformers"]["latency"]["completed"] == 3


def test_speculative_config_runs_beside_the_plain_engine_with_the_same_tokens(tiny, tmp_path):
    """--speculative-config: a second engine of ours with speculation; its acceptance per run, its ratio to
    the plain engine, and a check that it produced the plain engine's tokens (greedy)."""
    report = tmp_path / "spec.json"
    spec = json.dumps({"method": "draft_model", "model": str(tiny), "num_speculative_tokens": 2})
    result = bench("throughput", "--model", tiny, "--num-requests", 3, "--input-len", 4, 9, "--output-len", 7, 7,
                   "--decode-tokens", 7, "--speculative-config", spec, "--json", report, *QUICK)
    assert result.exit_code == 0, result.output
    doc = json.loads(report.read_text())
    label = "toolkit (eager, draft_model k=2)"
    spec_res, plain = doc["systems"][label], doc["systems"]["toolkit (eager)"]
    assert spec_res["tokens_identical_to_plain"] is True and "tokens identical to toolkit (eager)'s" in result.output
    # The target as its own draft: every draft kept. 7 tokens = 1 from the prefill + 2 verify steps of 3.
    for run in ("throughput", "decode"):
        counts = spec_res["spec_decode"][run]
        requests = 3 if run == "throughput" else 1
        assert counts["num_drafts"] == 2 * requests and counts["num_draft_tokens"] == 4 * requests
        assert counts["acceptance_rate_pct"] == 100 and counts["mean_acceptance_length"] == 3
        assert counts["acceptance_per_pos_pct"] == [100, 100]
    assert "spec_decode" not in plain
    row = next(r for r in doc["rows"] if r["metric"] == "decode tokens/s")
    assert row["ratios"][f"{label} / toolkit (eager)"] == pytest.approx(
        row["values"][label] / row["values"]["toolkit (eager)"])
    rate = next(r for r in doc["rows"] if r["metric"] == "workload: acceptance rate")
    assert rate["values"][label] == 100 and rate["values"]["toolkit (eager)"] is None
    bad = bench("throughput", "--model", tiny, "--speculative-config", '{"method": "x"}', *QUICK)
    assert bad.exit_code == 2 and "speculative_config" in bad.output


def test_variants_and_kv_counters_on_a_shared_prefix_workload(tiny, tmp_path):
    """--variant runs our engine again with other EngineConfig fields beside the first run: here with
    prefix caching off and with a CPU tier, on vLLM's prefix_repetition shape; every run reports its
    hit rate per tier, its ratio to the first run, and that it produced the first run's tokens."""
    report = tmp_path / "kv.json"
    result = bench("throughput", "--model", tiny, "--workload", "prefix-repetition", "--prefix-repetition", 2, 40, 8, 4,
                   "--num-requests", 6, "--max-num-batched-tokens", 48, "--decode-tokens", 0,
                   "--variant", '{"enable_prefix_caching": false}', "--json", report, *QUICK)
    assert result.exit_code == 0, result.output
    doc = json.loads(report.read_text())
    base, off = doc["systems"]["toolkit (eager)"], doc["systems"]["toolkit (eager, enable_prefix_caching=False)"]
    assert off["tokens_identical_to_plain"] is True
    # One request per step's budget, so each prefix misses once (its first request) and hits 32 of
    # its 40 tokens (whole blocks) in the other two: 4 x 32 of 6 x 48 queried tokens.
    assert base["kv_cache"]["throughput"]["hits"] == 4 * 32 and base["kv_cache"]["throughput"]["queries"] == 6 * 48
    assert off["kv_cache"]["throughput"]["hits"] == 0
    row = next(r for r in doc["rows"] if r["metric"].startswith("prefix cache hit rate"))
    assert row["values"]["toolkit (eager)"] == pytest.approx(100 * 128 / 288)
    assert doc["workload"]["source"] == "prefix-repetition" and doc["workload"]["distinct_prompt_tokens"] == 2 * 40 + 6 * 8

    turns = bench("throughput", "--model", tiny, "--workload", "multi-turn", "--multi-turn", 3, 3, 20, 4,
                  "--decode-tokens", 0, "--variant", '{"kv_offloading_size": 0.01}', "--json", report, *QUICK)
    assert turns.exit_code == 0, turns.output
    doc = json.loads(report.read_text())
    tier = doc["systems"]["toolkit (eager, kv_offloading_size=0.01)"]
    assert tier["tokens_identical_to_plain"] is True
    assert tier["kv_cache"]["throughput"]["cpu_hits"] > 0 and tier["kv_cache"]["throughput"]["device_to_cpu_mib"] > 0
    # The device cache is a third of the working set: 3 conversations of 3 x 24 - 4 tokens.
    assert doc["settings"]["kv_cache_bytes_ours"] < doc["workload"]["distinct_prompt_tokens"] * 512
    bad = bench("throughput", "--model", tiny, "--variant", '{"no_such_field": 1}', *QUICK)
    assert bad.exit_code == 2 and "no_such_field" in bad.output


def test_cli_errors(tiny):
    r = CliRunner().invoke(bench_app, ["throughput", "--model", str(tiny), "--peer", "nope", "--no-progress"])
    assert r.exit_code == 2 and "unknown --peer" in r.output
    r = CliRunner().invoke(bench_app, ["throughput", "--model", str(tiny), "--peer", "vllm", "--no-progress"],
                           env={"TOOLKIT_BENCH_VLLM_PYTHON": None})
    assert r.exit_code == 2 and "--peer-python" in r.output
    r = CliRunner().invoke(bench_app, ["throughput", "--no-progress"])
    assert r.exit_code == 2 and "--model" in r.output


def test_bf16_roofline_is_float32_where_that_is_faster():
    bf16 = {"dtype": "bfloat16", "flops_per_s": 20e9}
    fp32 = {"dtype": "float32", "flops_per_s": 150e9}
    assert compute_peak(bf16, fp32) is fp32  # emulated bf16 (AVX2): float32 FMAs are the machine's peak
    native = {"dtype": "bfloat16", "flops_per_s": 400e9}
    assert compute_peak(native, fp32) is native  # bf16 units (AMX, AVX-512 BF16)
    assert compute_peak(fp32, bf16) is fp32  # a float32 model keeps its own peak


def test_roofline_is_the_best_of_the_probes_before_and_after():
    before = {"n": 2048, "dtype": "float32", "seconds": 0.2, "flops_per_s": 86e9}
    after = {"n": 2048, "dtype": "float32", "seconds": 0.11, "flops_per_s": 151e9}
    best = best_of_probes(before, after)
    assert best["flops_per_s"] == 151e9 and best["seconds"] == 0.11
    assert best["flops_per_s_samples"] == [86e9, 151e9]
    bw = best_of_probes({"bytes": 8, "read_bytes_per_s": 26e9, "copy_bytes_per_s": 10e9},
                        {"bytes": 8, "read_bytes_per_s": 20e9, "copy_bytes_per_s": 12e9})
    assert bw["read_bytes_per_s"] == 26e9 and bw["copy_bytes_per_s"] == 12e9  # each rate's own best
    # Any number of probes, an already combined one included: its samples count, not only its best.
    more = best_of_probes(bw, {"bytes": 8, "read_bytes_per_s": 27e9, "copy_bytes_per_s": 11e9})
    assert more["read_bytes_per_s"] == 27e9 and more["read_bytes_per_s_samples"] == [26e9, 20e9, 27e9]
    assert more["copy_bytes_per_s"] == 12e9


def test_bandwidth_fraction_holds_each_decode_run_to_its_own_bound():
    # One run: bytes/token x tokens/s / bandwidth.
    assert bandwidth_fraction(100.0, [(10, 2.0, 1000.0)]) == pytest.approx(100 * 100 * 5 / 1000)
    # Two runs, each held to the bandwidth read beside it: the bound's time over the time taken.
    # Run 1 needs 10*100/1000 = 1 s at its bound and took 2 s; run 2 needs 10*100/500 = 2 s and took 2 s.
    assert bandwidth_fraction(100.0, [(10, 2.0, 1000.0), (10, 2.0, 500.0)]) == pytest.approx(75.0)
    assert bandwidth_fraction(100.0, []) == 0.0


def test_bf16_run_takes_the_faster_dtype_probe_as_roofline(tiny, tmp_path):
    report = tmp_path / "report.json"
    quick = [a if a != "float32" else "bfloat16" for a in QUICK]
    result = bench("throughput", "--model", tiny, "--num-requests", 2, "--input-len", 4, 6, "--output-len", 2, 3,
                   "--decode-tokens", 0, "--json", report, *quick)
    assert result.exit_code == 0, result.output
    roof = json.loads(report.read_text())["roofline"]
    bf16, fp32 = roof["matmul"], roof["matmul_other_dtype"]
    assert bf16["dtype"] == "bfloat16" and fp32["dtype"] == "float32"
    assert len(bf16["flops_per_s_samples"]) == len(fp32["flops_per_s_samples"]) == 2  # probed before and after
    assert roof["compute_peak"]["flops_per_s"] == max(bf16["flops_per_s"], fp32["flops_per_s"])
    ours = json.loads(report.read_text())["systems"]["toolkit (eager)"]["roofline"]
    assert ours["peak_fraction_pct"] == pytest.approx(100 * ours["gflops_per_s"] * 1e9 / roof["compute_peak"]["flops_per_s"])


def test_bubble_model_gives_back_the_measured_run_and_predicts_the_split_of_others():
    """Two stages of 2 layers over 10 plans and 100 fed tokens, 0.2 s of each stage's busy time host work;
    the last stage's extra compute is its head. At the measured pp the model must give back the
    bottleneck stage's wall time (busy + idle); at pp=3 the 4 layers split 1,2,1."""
    first = {"layers": [0, 2], "plans": 10, "busy_s": 1.0, "compute_s": 0.8, "idle_s": 0.3,
             "idle_fraction": 0.23, "decode_idle_fraction": 0.2}
    last = dict(first, layers=[2, 4], busy_s=1.2, compute_s=1.0, idle_s=0.1)
    model = bubble_model([first, last], num_layers=4, tokens_fed=100, output_tokens=50)
    assert model["layer_s_per_token"] == pytest.approx(0.004) and model["head_s_per_token"] == pytest.approx(0.002)
    assert model["host_s_per_plan"] == pytest.approx(0.02) and model["wait_s_per_plan"] == pytest.approx(0.01)
    by_pp = {p["pp"]: p for p in model["predicted"]}
    assert sorted(by_pp) == [1, 2, 3, 4]
    assert by_pp[2]["elapsed_s"] == pytest.approx(1.2 + 0.1)
    assert by_pp[2]["output_tokens_per_s"] == pytest.approx(50 / 1.3)
    assert by_pp[2]["idle_fraction"] == pytest.approx([1 - 0.10 / 0.13, 1 - 0.12 / 0.13])
    # One stage: 5 plans of every live request, no transfers.
    assert by_pp[1]["elapsed_s"] == pytest.approx(5 * (0.02 + (4 * 0.004 + 0.002) * 100 / 5))
    # Three stages: 15 plans; the middle stage holds 2 layers, the last 1 layer and the head.
    per = 100 / 15
    times = [0.02 + 0.004 * per, 0.02 + 0.008 * per, 0.02 + 0.006 * per]
    assert by_pp[3]["elapsed_s"] == pytest.approx(15 * (times[1] + 0.01))
    assert by_pp[3]["idle_fraction"] == pytest.approx([1 - t / (times[1] + 0.01) for t in times])
    with pytest.raises(ValueError, match="two or more stages"):
        bubble_model([first], num_layers=4, tokens_fed=100, output_tokens=50)


def test_pipeline_variant_runs_two_stages_with_the_plain_runs_tokens(tiny, tmp_path):
    """--variant '{"pipeline_parallel_size": 2}': our engine as 2 processes (torch.distributed.run), its
    tokens the single process's, each stage's idle share and the bubble model's prediction reported."""
    report = tmp_path / "pp.json"
    result = bench("throughput", "--model", tiny, "--num-requests", 6, "--input-len", 4, 12, "--output-len", 3, 8,
                   "--decode-tokens", 0, "--variant", '{"pipeline_parallel_size": 2}', "--json", report, *QUICK)
    assert result.exit_code == 0, result.output
    doc = json.loads(report.read_text())
    pp = doc["systems"]["toolkit (eager, pipeline_parallel_size=2)"]
    assert pp["tokens_identical_to_plain"] is True
    stages = pp["pipeline"]["stages"]
    assert [s["layers"] for s in stages] == [[0, 1], [1, 2]] and stages[0]["plans"] == stages[1]["plans"] > 0
    assert all(0 <= s["idle_fraction"] < 1 and s["max_in_flight"] == 2 for s in stages)
    assert pp["throughput"]["output_tokens"] == doc["systems"]["toolkit (eager)"]["throughput"]["output_tokens"]
    predicted = {p["pp"] for p in pp["pipeline"]["bubble_model"]["predicted"]}
    assert predicted == {1, 2}  # the tiny model has 2 layers
    assert "idle per stage over the timed run stage 1 (layers 0-0)" in result.output and "bubble model" in result.output
    bad = bench("latency", "--model", tiny, "--variant", '{"pipeline_parallel_size": 2}', *QUICK)
    assert bad.exit_code == 2 and "bench throughput` only" in bad.output


def test_mixed_workload_places_long_prompts_among_short_ones_arriving_as_a_seeded_poisson_stream():
    from toolkit.cli.bench.disaggregated import mixed_workload

    reqs = mixed_workload(40, 3, 50, (4, 9), 6, rate=20.0, vocab_size=VOCAB, seed=1)
    lens = [len(r["prompt_token_ids"]) for r in reqs]
    assert lens.count(50) == 3 and all(4 <= n <= 9 for n in lens if n != 50) and lens[:3] != [50] * 3
    arrivals = [r["arrival_s"] for r in reqs]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert 0.5 < arrivals[-1] / (39 / 20.0) < 2  # 39 gaps of mean 1/20 s
    assert reqs == mixed_workload(40, 3, 50, (4, 9), 6, rate=20.0, vocab_size=VOCAB, seed=1)
    assert {r["arrival_s"] for r in mixed_workload(5, 1, 50, (4, 9), 6, 0.0, VOCAB)} == {0.0}
    with pytest.raises(ValueError, match="long prompts"):
        mixed_workload(2, 3, 50, (4, 9), 6, 0.0, VOCAB)


def test_disagg_report_explains_differing_tokens_only_where_some_differ():
    """The report says why greedy tokens can differ from the colocated run's (near-ties, flipped by
    other summation orders: often in half types, rarely in float32) only when some request's do, and
    where each differing request first differs (a near-tie late in a sequence, a fault early)."""
    from toolkit.cli.bench.disaggregated import first_differences, report_lines

    latency = {"ttft_ms": {"median": 1.0, "p99": 2.0}, "tpot_ms": {"median": 1.0, "p99": 2.0},
               "itl_ms": {"p99": 2.0}, "output_tokens_per_s": 10.0}

    def lines(same: int) -> str:
        report = {"workload": {"requests": 6, "long_prompts": 1, "prompt_tokens": 60, "output_tokens": 24,
                               "prefill_to_decode_tokens": 2.5, "rate": 0.0},
                  "systems": {"colocated (dp=2)": {"latency": latency, "roles": []},
                              "disaggregated 1:1": {"latency": latency, "roles": [],
                                                    "requests_identical_to_colocated": same,
                                                    "first_differences": [[2, 3, 4]] * (6 - same)}}}
        return "\n".join(report_lines(report))

    assert "6 of 6 requests' tokens identical to the colocated run's\n" in lines(6) + "\n"
    assert "near-ties" not in lines(6)
    assert "5 of 6 requests' tokens identical" in lines(5) and "near-ties can flip" in lines(5)
    assert "rarely in float32" in lines(5) and "differing: request 2 from token 3 of 4 (" in lines(5)
    assert first_differences([[1, 2, 3], [4, 5], [6, 7]], [[1, 2, 3], [4, 9], [6, 7, 8]]) == [[1, 1, 2], [2, 2, 3]]


def test_disagg_rounds_mirror_the_order_and_count_as_one_run():
    """`--rounds`: the systems in order, then reversed; a system's rounds pooled (every request's
    latencies, output tokens over the summed time), each round's own figures kept and shown."""
    from toolkit.cli.bench.disaggregated import combine_rounds, report_lines, round_order
    from toolkit.cli.bench.metrics import RequestTiming, latency_metrics

    assert [s for _, s in round_order(["c", "a", "b"], 3)] == ["c", "a", "b", "b", "a", "c", "c", "a", "b"]
    assert [r for r, _ in round_order(["c", "a"], 2)] == [0, 0, 1, 1]

    def run(tpot: float, n: int, seconds: float) -> dict:
        # n requests of 5 tokens each, one token per `tpot` after a first token at 0.1 s
        timings = [RequestTiming(0.0, 3, [(0.1 + k * tpot, 1) for k in range(5)]) for _ in range(n)]
        return {"latency": latency_metrics(timings, seconds), "timings": [t.to_json() for t in timings],
                "roles": [], "tokens": [[n]]}

    one = combine_rounds([run(0.01, 4, 1.0), run(0.03, 2, 3.0)])
    lat = one["latency"]
    assert lat["completed"] == 6 and lat["output_tokens"] == 30 and lat["output_tokens_per_s"] == pytest.approx(7.5)
    assert lat["tpot_ms"]["median"] == pytest.approx(10.0) and lat["tpot_ms"]["p99"] == pytest.approx(30.0)
    assert one["tokens"] == [[4]] and "timings" not in one
    assert [r["latency"]["output_tokens_per_s"] for r in one["rounds"]] == [20.0, pytest.approx(10 / 3)]
    report = {"workload": {"requests": 6, "long_prompts": 1, "prompt_tokens": 18, "output_tokens": 30,
                           "prefill_to_decode_tokens": 0.6, "rate": 0.0}, "systems": {"colocated (dp=2)": one}}
    assert "  colocated (dp=2), each round: out tok/s 20.0 / 3.3, TPOT p99 10.0 / 30.0 ms" in report_lines(report)


def test_disagg_bench_runs_colocated_and_disaggregated_on_two_ranks_with_the_same_tokens(tiny, tmp_path):
    """`toolkit bench disagg`: the systems as 2-process jobs; every request completes with its tokens
    (float32, greedy: the same in all), and every prompt's KV went from the prefill to the decode
    instance and is counted on both sides; with a decode token cost (the same layout again, beside the
    same colocated run) the prefill instance serves some requests whole and hands over the rest."""
    report = tmp_path / "disagg.json"
    result = bench("disagg", "--model", tiny, "--num-requests", 6, "--long-prompts", 1, "--long-len", 40,
                   "--short-len", 3, 9, "--output-len", 4, "--eager", "--dtype", "float32", "--json", report,
                   "--decode-token-cost", 0, "--decode-token-cost", 4)
    assert result.exit_code == 0, result.output
    doc = json.loads(report.read_text())
    colocated, disagg = doc["systems"]["colocated (dp=2)"], doc["systems"]["disaggregated 1:1"]
    for system in (colocated, disagg):
        assert system["latency"]["completed"] == 6 and system["latency"]["output_tokens"] == 24
    assert disagg["requests_identical_to_colocated"] == 6 and all(len(t) == 4 for t in disagg["tokens"])
    prefill, decode = (next(r for r in disagg["roles"] if r["role"] == role) for role in ("prefill", "decode"))
    assert prefill["kv_run"]["transfers"] == decode["kv_run"]["transfers"] == 6
    assert prefill["kv_run"]["bytes"] == decode["kv_run"]["bytes"] > 0
    assert "TTFT p50" in result.output and "decode instance 0" in result.output
    serving = doc["systems"]["disaggregated 1:1, decode token cost 4"]
    assert serving["latency"]["completed"] == 6 and serving["requests_identical_to_colocated"] == 6
    prefill, decode = (next(r for r in serving["roles"] if r["role"] == role) for role in ("prefill", "decode"))
    served = prefill["served"]["requests"]
    assert 0 < served < 6 and prefill["kv_run"]["transfers"] == decode["kv_run"]["transfers"] == 6 - served
    assert f"{served} served whole" in result.output
    bad = bench("latency", "--model", tiny, "--variant", '{"prefill_instances": 1, "decode_instances": 1}', *QUICK)
    assert bad.exit_code == 2 and "toolkit bench disagg" in bad.output
    assert bench("disagg", "--model", tiny, "--layout", "1-1").exit_code == 2


def test_sampled_runs_count_every_token_and_compare_none(tiny, tmp_path):
    """--temperature: every system samples (ours plain and speculative, transformers), each is credited
    with exactly the requested tokens, and no run claims its tokens equal another's."""
    report = tmp_path / "sampled.json"
    spec = json.dumps({"method": "draft_model", "model": str(tiny), "num_speculative_tokens": 2})
    result = bench("throughput", "--model", tiny, "--num-requests", 3, "--input-len", 4, 9, "--output-len", 5, 7,
                   "--temperature", 0.8, "--speculative-config", spec, "--peer", "hf", "--hf-batch-size", 2,
                   "--decode-tokens", 4, "--json", report, *QUICK)
    assert result.exit_code == 0, result.output
    doc = json.loads(report.read_text())
    assert doc["workload"]["temperature"] == 0.8 and doc["workload"]["greedy"] is False
    assert "Sampled at temperature 0.8" in result.output and "tokens identical" not in result.output
    want_out = sum(r.output_len for r in random_workload(3, (4, 9), (5, 7), VOCAB, seed=0))
    for label in ("toolkit (eager)", "toolkit (eager, draft_model k=2)", "transformers"):
        assert doc["systems"][label]["throughput"]["output_tokens"] == want_out
    assert doc["systems"]["toolkit (eager, draft_model k=2)"]["tokens_identical_to_plain"] is None


def test_each_system_samples_at_the_bench_temperature(tiny, tmp_path, monkeypatch):
    """At a high temperature the random model's tokens leave the greedy path in ours and in transformers,
    and the vLLM worker is asked for that temperature; at 0 both of ours runs stay greedy."""
    requests = random_workload(3, (4, 9), (8, 8), VOCAB, seed=3)

    def ours(temperature):
        system = OursSystem(tiny, load_format="safetensors", dtype="float32", eager=True, max_model_len=64,
                            kv_cache_memory_bytes=None, max_num_seqs=8, max_num_batched_tokens=64,
                            temperature=temperature)
        system.start(requests[0])
        system.throughput(requests, no_progress)
        return system.tokens["throughput"]

    greedy = ours(0.0)
    assert ours(0.0) == greedy and ours(5.0) != greedy

    def hf(temperature):
        system = HFSystem(tiny, dtype=torch.float32, batch_size=3, temperature=temperature)
        system.start(requests[0])
        torch.manual_seed(0)
        return system._generate(requests, 8).tolist()

    assert hf(5.0) != hf(0.0)

    body = ("import json, sys\n"
            "spec = json.load(open(sys.argv[1]))\n"
            "assert spec['temperature'] == 5.0, spec['temperature']\n"
            "print(json.dumps({'event': 'result', 'result': {'version': 'x', 'startup': {'total_s': 1.0},"
            " 'throughput': {}}}))\n")
    monkeypatch.setattr("toolkit.cli.bench.systems.WORKER", fake_worker(tmp_path, body))
    system = VLLMSystem(tiny, python=Path(sys.executable), dtype="float32", eager=False, max_model_len=64,
                        max_num_seqs=8, max_num_batched_tokens=64, temperature=5.0)
    system.run(mode="throughput", requests=requests, warm=requests[0], concurrency=0, decode=None,
               phase=lambda name, total: (lambda n=1: None))
