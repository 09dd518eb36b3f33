"""`toolkit bench`: our engine's throughput and latency against peers measured in the same run.

- `app.py`: the Typer commands and the run (systems in turn, probes beside them, the report);
- `workload.py`: random or dataset requests; `model.py`: the named model shapes;
- `systems.py`: our engine, transformers and vLLM (`vllm_worker.py`, in vLLM's own environment);
- `metrics.py`: TTFT, TPOT, ITL, throughput; `roofline.py`: matmul peak, bandwidth, FLOPs and bytes;
- `report.py`: the table and the JSON;
- `serving.py`: `toolkit bench serve`, online serving against our server and `vllm serve` over HTTP;
- `suite.py`: `toolkit bench suite`, every goal row as its own bench, into one JSON; `goals.py`: the
  goals table read from it (`toolkit bench table`), and the README's block per host kind.
"""

from toolkit.cli.bench.app import bench_app

__all__ = ["bench_app"]
