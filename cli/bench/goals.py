"""The performance goals table, read from a `toolkit bench suite` JSON, and the README's copy of it.

Every figure is a ratio taken in one run (ours / the peer beside it) or a fraction of the roofline
that run measured, read from the row's own report; nothing here is typed in by hand. The README
holds one table per host kind, between `<!-- bench-table:KIND:start -->` and `...:end -->`;
`toolkit bench table SUITE.json --readme README.md` rewrites that host kind's block (or adds it
after the `<!-- bench-tables -->` line) and leaves the other host kinds' blocks as they are.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from toolkit.cli.bench.report import lookup
from toolkit.cli.bench.roofline import HOST_KINDS

ANCHOR = "<!-- bench-tables -->"


@dataclass
class Goal:
    workload: str
    dtype: str
    goal: str
    value: float | None  # None: the row did not run or lacks the figure
    target: float
    higher: bool  # the goal is value >= target (else <=)
    unit: str  # "x", "%" or " s"
    detail: str = ""

    tokens_equal: bool | None = None  # a speculative row's: different tokens fail its goal at any speed

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        if self.tokens_equal is False:
            return False
        return self.value >= self.target if self.higher else self.value <= self.target

    def shown(self) -> str:
        if self.value is None:
            return "not measured" + (f" ({self.detail})" if self.detail else "")
        text = f"{self.value:.2f}x" if self.unit == "x" else f"{self.value:.1f}{self.unit}"
        return text + (f" ({self.detail})" if self.detail else "")


def _ratio(a, b):
    return a / b if a is not None and b else None


def _systems(report: dict | None) -> tuple[dict, dict, dict, dict]:
    """(our plain run, our speculative run, vLLM, transformers) of a bench report; {} where absent."""
    systems = lookup(report, "systems") or {}
    ours = [v for v in systems.values() if v.get("kind") == "ours"]
    plain = next((v for v in ours if "tokens_identical_to_plain" not in v), {})
    spec = next((v for v in ours if "tokens_identical_to_plain" in v), {})
    vllm = next((v for k, v in systems.items() if k.startswith("vLLM")), {})
    return plain, spec, vllm, systems.get("transformers", {})


def _tok_s(system: dict):
    return lookup(system, "throughput", "output_tokens_per_s")


def _decode(system: dict):
    return lookup(system, "decode", "decode_tokens_per_s")


def _why(entry: dict | None) -> str:
    if entry is None:
        return "row not run"
    return entry.get("not_run") or ("row failed" if "error" in entry else "")


def _vs(workload: str, dtype: str, goal: str, target: float, ours, peer, peer_name: str, unit: str, why: str) -> Goal:
    """ours / peer against `target`, with both figures shown (or why there is no ratio)."""
    if ours is not None and peer:
        detail = f"{ours:,.1f} / {peer:,.1f} {unit}"
    else:
        detail = why or (f"no {peer_name} figure in this run" if ours is not None else "no figure of ours")
    return Goal(workload, dtype, goal, _ratio(ours, peer), target, True, "x", detail)


def _throughput_goals(entry: dict | None, workload: str, dtype: str, batch1: bool) -> list[Goal]:
    ours, _, vllm, hf = _systems(lookup(entry, "report"))
    why = _why(entry)
    out = [
        _vs(workload, dtype, ">= 1.3x vLLM-cpu", 1.3, _tok_s(ours), _tok_s(vllm), "vLLM", "output tok/s", why),
        _vs(workload, dtype, ">= 4x transformers", 4.0, _tok_s(ours), _tok_s(hf), "transformers", "output tok/s", why),
        Goal(workload, dtype, ">= 60% of the matmul peak", lookup(ours, "roofline", "peak_fraction_pct"), 60.0, True, "%",
             why),
    ]
    if batch1:
        name = workload.replace("default workload", "batch-1 decode")
        out += [_vs(name, dtype, ">= 2x vLLM-cpu", 2.0, _decode(ours), _decode(vllm), "vLLM", "tok/s", why),
                Goal(name, dtype, ">= 80% of the read bandwidth measured beside it",
                     lookup(ours, "decode", "bandwidth_fraction_beside_pct"), 80.0, True, "%", why)]
    return out


def _ngram_goal(entry: dict | None) -> Goal:
    plain, spec, _, _ = _systems(lookup(entry, "report"))
    dtype = lookup(entry, "report", "model", "dtype") or "-"
    what = lookup(entry, "what") or "n-gram at batch 1"
    same = spec.get("tokens_identical_to_plain")
    accepted = lookup(spec, "spec_decode", "decode", "acceptance_rate_pct")
    detail = _why(entry) or ("no draft proposed in the batch-1 run" if accepted is None
                             else f"{accepted:.0f}% of drafts accepted")
    if same is not None:
        detail += "; tokens equal" if same else "; tokens DIFFERENT from the plain run's"
    goal = Goal(what, dtype, ">= 1.8x plain, tokens equal", _ratio(_decode(spec), _decode(plain)), 1.8, True, "x", detail)
    goal.tokens_equal = same
    return goal


def goals(doc: dict) -> list[Goal]:
    rows = doc.get("rows", {})
    out: list[Goal] = []
    for dtype in doc.get("dtypes", []):
        for key, batch1 in ((f"throughput-real-{dtype}", True), (f"throughput-dense-{dtype}", False)):
            entry = rows.get(key)
            out += _throughput_goals(entry, lookup(entry, "what") or key, dtype, batch1)
    entry = rows.get("prefix")
    ours, _, vllm, _ = _systems(lookup(entry, "report"))
    dtype = lookup(entry, "report", "model", "dtype") or "-"
    shape, n = lookup(entry, "report", "workload", "prefix_repetition"), lookup(entry, "report", "workload", "num_requests")
    what = (f"W2: {shape[0]} x {shape[1]:,}-token shared prefixes, {n} requests, {Path(lookup(entry, 'report', 'model', 'path') or '-').name}"
            if shape and n else lookup(entry, "what") or "W2 shared prefixes")
    out.append(_vs(what, dtype, ">= 1.3x vLLM-cpu with its prefix caching", 1.3,
                   _tok_s(ours), _tok_s(vllm), "vLLM", "output tok/s", _why(entry)))
    entry = rows.get("moe")
    ours, _, vllm, hf = _systems(lookup(entry, "report"))
    dtype = lookup(entry, "report", "model", "dtype") or "-"
    what = lookup(entry, "what") or "MoE"
    out.append(_vs(what, dtype, ">= 1.2x vLLM-cpu", 1.2, _tok_s(ours), _tok_s(vllm), "vLLM", "output tok/s", _why(entry)))
    out.append(_vs(what, dtype, ">= 3x transformers", 3.0, _tok_s(ours), _tok_s(hf), "transformers", "output tok/s",
                   _why(entry)))
    out.append(_ngram_goal(rows.get("ngram")))
    entry = rows.get("startup")
    report = lookup(entry, "report") or {}
    what = lookup(entry, "what") or "start-up"
    detail = _why(entry) if not report else ("" if report.get("answers_equal") else "answers DIFFERED between runs")
    out.append(Goal(what, "auto", "warm <= 5 s", report.get("warm_s"), 5.0, False, " s", detail))
    out.append(Goal(what, "auto", "cold <= 20 s", report.get("cold_s"), 20.0, False, " s", detail))
    return out


def markdown(doc: dict, source: str) -> str:
    host = doc.get("host", {})
    kind = host.get("host_kind", "other")
    lines = [f"#### {HOST_KINDS.get(kind, kind)}: {host.get('cpu', '?')}, {host.get('cpu_count', '?')} cores, "
             f"{str(doc.get('date', '?'))[:10]}, commit {doc.get('commit') or '?'}", "",
             "| workload | dtype | goal | measured | met |", "|---|---|---|---|---|"]
    for g in goals(doc):
        met = {True: "yes", False: "**no**", None: "-"}[g.met]
        lines.append(f"| {g.workload} | {g.dtype} | {g.goal} | {g.shown()} | {met} |")
    commits = sorted({r["commit"] for r in doc.get("rows", {}).values() if r.get("commit")} - {doc.get("commit")})
    lines += ["", f"Generated by `toolkit bench table {source}` from `toolkit bench suite`'s JSON (torch "
                  f"{host.get('torch', '?')}); every ratio is taken in one run."
              + (f" Some rows ran at an earlier commit: {', '.join(commits)}." if commits else "")]
    return "\n".join(lines)


def _block(kind: str, body: str) -> str:
    return f"<!-- bench-table:{kind}:start -->\n{body}\n<!-- bench-table:{kind}:end -->"


def write_readme(readme: Path, doc: dict, source: Path | str) -> None:
    """Replace this host kind's block, or add it after the anchor line."""
    kind = doc.get("host", {}).get("host_kind", "other")
    text = readme.read_text()
    block = _block(kind, markdown(doc, str(source)))
    pattern = re.compile(rf"<!-- bench-table:{re.escape(kind)}:start -->.*?<!-- bench-table:{re.escape(kind)}:end -->",
                         re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    elif ANCHOR in text:
        text = text.replace(ANCHOR, f"{ANCHOR}\n\n{block}", 1)
    else:
        raise typer.BadParameter(f"{readme} has neither a bench-table block for {kind} nor a {ANCHOR} line")
    readme.write_text(text)


def print_goals(doc: dict, source: Path | str) -> None:
    typer.echo(markdown(doc, str(source)))


def table(
    suite_json: Annotated[Path, typer.Argument(dir_okay=False, exists=True, help="A `toolkit bench suite` JSON.")],
    readme: Annotated[Optional[Path], typer.Option(
        "--readme", dir_okay=False, exists=True,
        help="Write the table into this README's block for the JSON's host kind instead of only printing it.")] = None,
):
    """The performance goals table (markdown) from a `toolkit bench suite` JSON."""
    try:
        doc = json.loads(suite_json.read_text())
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"{suite_json} is not JSON ({e.msg})") from None
    if not isinstance(doc, dict) or "rows" not in doc:
        raise typer.BadParameter(f"{suite_json} is not a `toolkit bench suite` JSON (no rows)")
    print_goals(doc, suite_json)
    if readme is not None:
        write_readme(readme, doc, suite_json)
