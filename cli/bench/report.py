"""The benchmark report: one row per figure, one column per system, and our ratio to each peer.

A ratio is always ours / peer, so > 1 means ours is larger: better for rows marked "higher is
better" (throughput, roofline fractions), worse for rows marked "lower is better" (times).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rich.table import Table

HIGHER, LOWER = "higher", "lower"


@dataclass
class Row:
    section: str
    metric: str
    unit: str
    better: str  # HIGHER or LOWER
    values: dict[str, float | None]
    ratios: dict[str, float | None] = field(default_factory=dict)


def lookup(d: dict | None, *path):
    """d[path[0]][path[1]]..., or None where a key is missing."""
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


# (section, metric, unit, better, path into a system's result)
THROUGHPUT_ROWS = [
    ("throughput", "output tokens/s", "tok/s", HIGHER, ("throughput", "output_tokens_per_s")),
    ("throughput", "total tokens/s", "tok/s", HIGHER, ("throughput", "total_tokens_per_s")),
    ("throughput", "requests/s", "req/s", HIGHER, ("throughput", "requests_per_s")),
    ("throughput", "elapsed", "s", LOWER, ("throughput", "elapsed_s")),
]
LATENCY_ROWS = [
    ("latency", f"{name} {stat}", "ms", LOWER, ("latency", key, stat))
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2EL", "e2el_ms"))
    for stat in ("mean", "median", "p99")
] + [
    ("latency", "output tokens/s", "tok/s", HIGHER, ("latency", "output_tokens_per_s")),
    ("latency", "requests/s", "req/s", HIGHER, ("latency", "requests_per_s")),
]
SPEC_ROWS = [
    ("speculation", f"{run}: {name}", unit, HIGHER, ("spec_decode", key, field))
    for run, key in (("workload", None), ("batch-1 decode", "decode"))
    for name, unit, field in (("acceptance rate", "%", "acceptance_rate_pct"),
                              ("mean acceptance length", "tok/step", "mean_acceptance_length"))
]
KV_ROWS = [
    ("KV cache", name, unit, better, ("kv_cache", None, key))
    for name, unit, better, key in (
        ("prefix cache hit rate (of prompt tokens)", "%", HIGHER, "hit_rate_pct"),
        ("hits on the device", "%", HIGHER, "device_hit_pct"),
        ("hits from the CPU tier", "%", HIGHER, "cpu_hit_pct"),
        ("hits from the disk tier", "%", HIGHER, "disk_hit_pct"),
        ("moved device -> CPU", "MiB", LOWER, "device_to_cpu_mib"),
        ("moved CPU -> device", "MiB", LOWER, "cpu_to_device_mib"),
        ("moved device -> disk", "MiB", LOWER, "device_to_disk_mib"),
        ("moved disk -> device", "MiB", LOWER, "disk_to_device_mib"),
    )
]
EXPERT_ROWS = [
    ("experts", name, unit, LOWER, ("experts", None, key))
    for name, unit, key in (("busiest expert's load / mean, worst layer", "x", "max_over_mean_worst"),
                            ("busiest expert's load / mean, mean of layers", "x", "max_over_mean_mean"))
]
COMMON_ROWS = [
    ("start-up", "start-up (construct + warm-up)", "s", LOWER, ("startup", "total_s")),
    ("start-up", "load", "s", LOWER, ("startup", "load_s")),
    ("start-up", "compile", "s", LOWER, ("startup", "compile_s")),
    ("roofline", "useful compute", "GFLOP/s", HIGHER, ("roofline", "gflops_per_s")),
    ("roofline", "fraction of matmul peak", "%", HIGHER, ("roofline", "peak_fraction_pct")),
    ("batch-1 decode", "decode tokens/s", "tok/s", HIGHER, ("decode", "decode_tokens_per_s")),
    ("batch-1 decode", "fraction of memory bandwidth (the run's best reading)", "%", HIGHER,
     ("decode", "bandwidth_fraction_pct")),
    ("batch-1 decode", "fraction of memory bandwidth (read beside the decode run)", "%", HIGHER,
     ("decode", "bandwidth_fraction_beside_pct")),
]


def ratio_name(ours: str, peer: str) -> str:
    return f"{ours} / {peer}"


def build_rows(command: str, systems: dict[str, dict], ours: list[str], peers: list[str],
               pairs: list[tuple[str, str]] = ()) -> list[Row]:
    """Rows for every figure at least one system has; ratios of each of ours to each peer, and of each
    (a, b) in `pairs` (a speculative run to its plain run)."""
    per_run = [(s, m, u, b, path if path[1] else (path[0], command, path[2])) for s, m, u, b, path in SPEC_ROWS + KV_ROWS + EXPERT_ROWS]
    specs = (THROUGHPUT_ROWS if command == "throughput" else LATENCY_ROWS) + per_run + COMMON_ROWS
    rows = []
    for section, metric, unit, better, path in specs:
        values = {label: lookup(systems[label], *path) for label in systems}
        if all(v is None for v in values.values()) or (section == "KV cache" and not any(values.values())):
            continue
        ratios = {}
        for a, b in [(o, p) for p in peers for o in ours] + list(pairs):
            x, y = values.get(a), values.get(b)
            ratios[ratio_name(a, b)] = x / y if x is not None and y not in (None, 0) else None
        rows.append(Row(section, metric, unit, better, values, ratios))
    return rows


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.1f}"
    return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"


def _fmt_ratio(r: float | None, better: str) -> str:
    if r is None:
        return "-"
    good = r >= 1 if better == HIGHER else r <= 1
    return f"[{'green' if good else 'red'}]{r:.2f}x[/]"


def render_table(rows: list[Row], title: str, caption: str | None = None) -> Table:
    systems = list(rows[0].values) if rows else []
    ratio_cols = list(rows[0].ratios) if rows else []
    table = Table(title=title, caption=caption, show_lines=False, caption_justify="left")
    table.add_column("section", style="dim")
    table.add_column("metric")
    table.add_column("unit", style="dim")
    for s in systems:
        table.add_column(s, justify="right")
    for r in ratio_cols:
        table.add_column(r, justify="right")
    previous = None
    for row in rows:
        if previous is not None and row.section != previous:
            table.add_section()
        arrow = "↑" if row.better == HIGHER else "↓"
        table.add_row(row.section if row.section != previous else "", f"{row.metric} {arrow}", row.unit,
                      *(_fmt(row.values.get(s)) for s in systems),
                      *(_fmt_ratio(row.ratios.get(r), row.better) for r in ratio_cols))
        previous = row.section
    return table


def report_json(command: str, rows: list[Row], **sections) -> dict:
    """What --json writes: the table's rows (values and ratios) plus every section of the report."""
    return {"command": command, **sections, "rows": [asdict(r) for r in rows]}
