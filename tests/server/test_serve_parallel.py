"""`toolkit serve --tp 2`, `--pp 2`, `--dp 2` and one prefill + one decode instance (one whose prefill
instance also serves some requests whole, one whose decode instance is a two-stage pipeline, and one
whose decode instance is two replicas): the command
relaunches itself as two processes (three) (gloo on CPU), rank 0 serves HTTP and hands each step's new
requests and aborts to the other rank; with --dp each request goes to one replica, whose news rank 0
gathers after each step (both replicas serve some: their routed counts; the KV gauges count both
replicas' blocks); disaggregated, rank 0 is the prefill instance and gathers the decode instance's
news (with --decode-token-cost its own news too, for the requests it served whole: handed over and
served whole add up to every finished request).

Oracle: `LLM.generate` in one process on the same checkpoint: greedy text streamed and not, a list
of prompts, seeded n=2. A client that disconnects mid-stream aborts on both ranks (every block free
after, and the next answers still equal the oracle's: the ranks stayed in step). SIGTERM to the
launcher stops both ranks, exit code 0. One launch per layout (each is two processes on a shared
2-core machine).
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.checkpoints import random_prompts, write_checkpoint, write_tokenizer
from tests.server.server_process import Server
from toolkit import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

CONTEXT = 4096  # long enough that a request still runs when its client goes away
FLAGS = ["--eager", "--dtype", "float32", "--kv-cache-memory", "4MiB"]
PROMPTS = ["hello world", "a list comprehension is", "tensor parallel"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tokenizer(write_checkpoint(tmp_path_factory.mktemp("llama"), "llama3", seed=3,
                                            max_position_embeddings=CONTEXT))


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=4 * 2**20)


@pytest.fixture(scope="module", params=[["--tp", 2], ["--pp", 2], ["--dp", 2],
                                        ["--prefill-instances", 1, "--decode-instances", 1, "--decode-token-cost", 4],
                                        ["--prefill-instances", 1, "--decode-instances", 1, "--pp", 2, "--prefill-pp", 1],
                                        ["--prefill-instances", 1, "--decode-instances", 1, "--dp", 2]],
                ids=["tp2", "pp2", "dp2", "1p1d-prefill-serves", "1p1d-decode-pp2", "1p1d-decode-dp2"])
def server(request, ckpt):
    server = Server(ckpt, *FLAGS, *request.param, "--served-model-name", "tiny", env={"OMP_NUM_THREADS": "1"})
    server.replicas = 2 if request.param[0] == "--dp" else 1  # colocated replicas (a decode instance's are routed apart)
    server.disaggregated = request.param[0] == "--prefill-instances"
    server.prefill_serves = "--decode-token-cost" in request.param
    yield server
    code, stderr = server.stop()
    assert code == 0, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]


def test_answers_equal_the_single_process(server, llm):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected):
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
        assert whole.choices[0].text == want.outputs[0].text
        assert whole.usage.completion_tokens == len(want.outputs[0].token_ids)
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True))
        assert text == want.outputs[0].text
    ids = random_prompts(4, seed=2)
    many = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=6),
                        use_tqdm=False)
    answer = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in answer.choices] == [m.outputs[0].text for m in many]
    seeded = llm.generate(PROMPTS[0], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8), use_tqdm=False)[0]
    answer = client.completions.create(model="tiny", prompt=PROMPTS[0], n=2, temperature=1.0, seed=3, max_tokens=8)
    assert [c.text for c in sorted(answer.choices, key=lambda c: c.index)] == [s.text for s in seeded.outputs]
    metrics = server.metrics()
    routed = [v for (name, _), v in metrics.items() if name == "toolkit:dp_requests_routed_total"]
    assert len(routed) == (server.replicas if server.replicas > 1 else 0) and all(routed), metrics
    # Disaggregated: rank 0's (the prefill instance's) metrics count the prompts' KV it sent.
    sent = [v for (name, labels), v in metrics.items() if name == "toolkit:disagg_kv_transfers_total"
            and ("role", "prefill") in labels]
    assert (sum(sent) > 0) == server.disaggregated, metrics
    # --decode-token-cost: the prefill instance answered some of the requests whole, and handed over the rest.
    if server.disaggregated:
        finished = sum(v for (name, _), v in metrics.items() if name == "toolkit:request_success_total")
        whole = sum(v for (name, _), v in metrics.items() if name == "toolkit:disagg_served_whole_requests_total")
        assert (whole > 0) == server.prefill_serves and sum(sent) + whole == finished, (sent, whole, finished)
    if server.replicas > 1:  # each replica has the single process's memory and blocks
        assert metrics[("toolkit:kv_cache_blocks", ())] == llm.engine.scheduler.kv_cache.num_blocks * server.replicas


def test_a_disconnect_aborts_on_every_rank_and_they_stay_in_step(server, llm):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": CONTEXT - 8, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    aborted = ("toolkit:request_success_total", (("finished_reason", "abort"),))
    deadline = time.monotonic() + 60
    while (m := server.metrics()).get(aborted, 0) < 1 or m[("toolkit:kv_cache_usage_perc", ())] != 0:
        assert time.monotonic() < deadline, f"not aborted, or blocks still held: {m}"
        time.sleep(0.1)
    want = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
