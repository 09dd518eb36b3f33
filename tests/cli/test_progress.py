"""The progress bar under --dp: rank 0 counts every replica's records from their shard files."""

from __future__ import annotations

import io
import json

from rich.console import Console

from toolkit.cli.progress import Reporter, ShardCounter


def record(line: int, tokens: int) -> str:
    return json.dumps({"id": line, "line": line, "usage": {"completion_tokens": tokens}}) + "\n"


def test_shard_counter_reads_only_whole_new_lines(tmp_path):
    a, b = tmp_path / "out.jsonl.dp0-of-2", tmp_path / "out.jsonl.dp1-of-2"
    counter = ShardCounter([a, b])
    assert counter.poll() == (0, 0)  # no shard yet
    a.write_text(record(2, 5) + record(4, 7)[:10])  # the second record is being written
    assert counter.poll() == (1, 5)
    a.write_text(record(2, 5) + record(4, 7))
    b.write_text(record(1, 3) + json.dumps({"id": 5, "line": 5, "outputs": None, "error": "bad"}) + "\n")
    assert counter.poll() == (4, 15)  # an error record is a line done, with no tokens
    assert counter.poll() == (4, 15)  # nothing new: nothing counted twice


def test_the_bar_counts_every_replicas_records_to_the_end(tmp_path):
    shards = [tmp_path / f"out.jsonl.dp{i}-of-2" for i in range(2)]
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=False, width=120)
    with Reporter(console, total=5, done=1, show_bar=True, follow=ShardCounter(shards)) as reporter:
        shards[0].write_text(record(2, 4) + record(4, 4))
        reporter.advance(4)  # rank 0's own records are in its shard: not counted twice
        reporter.advance(4)
        shards[1].write_text(record(3, 4) + record(5, 4))  # the other replica finishes after rank 0
    assert " 5/5 " in stream.getvalue(), stream.getvalue()
