"""`toolkit serve` end to end: the real `openai` client against a server subprocess on a free loopback
port, a tiny seeded checkpoint in float32.

Oracle: `LLM.generate` / `LLM.chat` in this process on the same checkpoint and engine settings:
greedy text and token counts exact, seeded sampling exact (a seeded request does not depend on its
batch), logprobs close. One server serves the module; a second, with one slot and one waiting place,
shows overload (503) and is then stopped by SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import httpx
import openai
import pytest

from tests.checkpoints import random_prompts, write_checkpoint, write_tokenizer
from tests.server.server_process import Server
from toolkit import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MAX_MODEL_LEN = 512
FLAGS = ["--eager", "--dtype", "float32", "--max-model-len", MAX_MODEL_LEN, "--kv-cache-memory", "8MiB"]
PROMPTS = ["hello world", "a list comprehension is", "the quick brown fox jumps", "tensor parallel"]
MESSAGES = [{"role": "user", "content": "What is a list?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tokenizer(write_checkpoint(tmp_path_factory.mktemp("llama"), "llama3", seed=3))


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(ckpt):
    server = Server(ckpt, *FLAGS, "--served-model-name", "tiny")
    yield server
    code, stderr = server.stop()
    assert code == 0, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def streamed(chunks) -> tuple[dict[int, str], dict[int, str], dict | None]:
    """(text per choice, finish reason per choice, usage) of a completions or chat stream."""
    text, finish, usage = {}, {}, None
    for chunk in chunks:
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            text[c.index] = text.get(c.index, "") + piece
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return text, finish, usage


# --- answers ------------------------------------------------------------------------------------------


def test_completions_streamed_and_not_equal_llm_generate_with_exact_usage(client, llm):
    expected = llm.generate(PROMPTS, greedy(12), use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected):
        seq = want.outputs[0]
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert whole.choices[0].text == seq.text and whole.choices[0].finish_reason == seq.finish_reason
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(want.prompt_token_ids),
                                                                              len(seq.token_ids))
        assert whole.usage.total_tokens == len(want.prompt_token_ids) + len(seq.token_ids)
        text, finish, usage = streamed(client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert text == {0: seq.text} and finish == {0: seq.finish_reason}
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)


def test_chat_streamed_and_not_equal_llm_chat(client, llm):
    seq = llm.chat(MESSAGES, greedy(10), use_tqdm=False)[0].outputs[0]
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == seq.text
    assert whole.usage.completion_tokens == len(seq.token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text, finish, usage = streamed(chunks)
    assert text == {0: seq.text} and finish == {0: seq.finish_reason} and usage is None


def test_a_stop_string_cuts_streamed_and_whole_text_as_llm_generate_does(client, llm):
    # A stop string from the middle of the greedy text, several characters long: a stream must not
    # send its first characters before it knows whether the rest follows.
    full = llm.generate(PROMPTS[2], greedy(24, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 4]
    assert len(stop) == 4
    want = llm.generate(PROMPTS[2], greedy(24, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and stop not in want.text
    body = dict(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop],
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**body)
    assert whole.choices[0].text == want.text and whole.choices[0].finish_reason == "stop"
    text, finish, _ = streamed(client.completions.create(**body, stream=True))
    assert text == {0: want.text} and finish == {0: "stop"}


def test_token_id_prompts_and_a_list_of_prompts_answer_in_order(client, llm):
    ids = random_prompts(3, seed=11)
    expected = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(8), use_tqdm=False)
    one = client.completions.create(model="tiny", prompt=ids[0], max_tokens=8, temperature=0)
    assert one.choices[0].text == expected[0].outputs[0].text
    many = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [e.outputs[0].text for e in expected]
    assert many.usage.prompt_tokens == sum(map(len, ids))
    assert many.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)


def test_n_2_seeded_sampling_equals_llm_generate(client, llm):
    want = llm.generate(PROMPTS[1], SamplingParams(n=2, temperature=1.0, top_k=50, seed=7, max_tokens=10),
                        use_tqdm=False)[0]
    body = dict(model="tiny", prompt=PROMPTS[1], n=2, temperature=1.0, seed=7, max_tokens=10, extra_body={"top_k": 50})
    whole = client.completions.create(**body)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == [s.text for s in want.outputs]
    assert whole.choices[0].text != whole.choices[1].text  # two draws, not one twice
    text, _, _ = streamed(client.completions.create(**body, stream=True))
    assert text == {0: want.outputs[0].text, 1: want.outputs[1].text}


def test_logprobs_equal_llm_generate(client, llm):
    seq = llm.generate(PROMPTS[0], greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    chosen = [entry[t].logprob for t, entry in zip(seq.token_ids, seq.logprobs)]
    whole = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(chosen, abs=1e-4)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(whole.choices[0].text)
    pieces = [json.loads(line.removeprefix("data: ")) for line in _sse_lines(client, {
        "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 3, "stream": True})]
    streamed_lp = [x for p in pieces for x in p["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed_lp == pytest.approx(chosen, abs=1e-4)
    assert [x for p in pieces for x in p["choices"][0]["logprobs"]["text_offset"]] == lp.text_offset

    chat = llm.chat(MESSAGES, greedy(5, logprobs=2), use_tqdm=False)[0].outputs[0]
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [entry[t].logprob for t, entry in zip(chat.token_ids, chat.logprobs)], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def _sse_lines(client, body: dict) -> list[str]:
    with httpx.stream("POST", f"{client.base_url}completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return lines[:-1]


def test_32_concurrent_streaming_clients_each_get_llm_generate_tokens(server, llm):
    ids = random_prompts(32, seed=5, high=60)
    expected = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(16, ignore_eos=True), use_tqdm=False)

    async def one(client, prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in ids))

    got = asyncio.run(all_of_them())
    assert got == [(e.outputs[0].text, 16) for e in expected]


def test_tokenize_and_models(server, llm):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[2]})
    assert r.status_code == 200 and r.json()["tokens"] == llm.engine.tokenize(PROMPTS[2])
    assert r.json()["count"] == len(r.json()["tokens"]) and r.json()["max_model_len"] == MAX_MODEL_LEN
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == llm.chat(MESSAGES, greedy(1), use_tqdm=False)[0].prompt_token_ids
    models = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none").models.list()
    assert [m.id for m in models.data] == ["tiny"]


# --- faults ---------------------------------------------------------------------------------------------


BAD = {
    "unknown field": {"prompt": "hi", "frobnicate": 1},
    "unknown model": {"model": "gpt-5", "prompt": "hi"},
    "negative temperature": {"prompt": "hi", "temperature": -1},
    "top_p zero": {"prompt": "hi", "top_p": 0},
    "n zero": {"prompt": "hi", "n": 0},
    "max_tokens not a number": {"prompt": "hi", "max_tokens": "many"},
    "no prompt": {"max_tokens": 3},
    "empty prompt": {"prompt": ""},
    "prompt of the wrong type": {"prompt": {"text": "hi"}},
    "token id outside the vocabulary": {"prompt": [1, 2, 10**6]},
    "prompt longer than max_model_len": {"prompt": [5] * (MAX_MODEL_LEN + 1)},
    "prompt + max_tokens over max_model_len": {"prompt": [5] * 10, "max_tokens": MAX_MODEL_LEN},
    "echo (not implemented)": {"prompt": "hi", "echo": True},
    "too many logprobs": {"prompt": "hi", "logprobs": 1000},
    "stream_options without stream": {"prompt": "hi", "stream_options": {"include_usage": True}},
    "logit_bias outside the vocabulary": {"prompt": "hi", "logit_bias": {"999999": 1}},
    "a body that is not an object": [1, 2],
}


@pytest.mark.parametrize("body", list(BAD.values()), ids=list(BAD))
def test_bad_requests_get_an_openai_400_and_the_server_keeps_serving(server, client, body):
    streamed_too = isinstance(body, dict) and "stream_options" not in body
    for payload in [body, {**body, "stream": True}] if streamed_too else [body]:
        r = httpx.post(f"{server.url}/v1/completions", json=payload, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"] and "Traceback" not in r.text
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None


def test_bad_json_chat_and_routes_get_json_errors(server):
    assert httpx.post(f"{server.url}/v1/completions", content=b"{not json").status_code == 400
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"content": "no role"}]})
    assert r.status_code == 400 and "messages[0]" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "tools": [{"type": "function"}]})
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0).completions.create(
            model="other", prompt="hi")


def test_a_client_that_disconnects_mid_stream_aborts_its_request_and_frees_every_block(server):
    before = server.metrics()
    aborted = ("toolkit:request_success_total", (("finished_reason", "abort"),))
    body = {"model": "tiny", "prompt": "hello", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # generating: then the client goes away
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = server.metrics()
        if now.get(aborted, 0) > before.get(aborted, 0) and now[("toolkit:num_requests_running", ())] == 0:
            break
        time.sleep(0.1)
    assert now.get(aborted, 0) == before.get(aborted, 0) + 1, "the request was not aborted"
    assert now[("toolkit:kv_cache_usage_perc", ())] == 0
    assert now[("toolkit:kv_cache_free_blocks", ())] == now[("toolkit:kv_cache_blocks", ())]
    # It stopped where the client left: far fewer tokens than it asked for were generated.
    generated = now[("toolkit:generation_tokens_total", ())] - before.get(("toolkit:generation_tokens_total", ()), 0)
    assert generated < MAX_MODEL_LEN - 8


def test_metrics_parse_and_counters_move_as_requests_complete(server, client):
    before = server.metrics()
    answer = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=7, temperature=0, n=2)
    after = server.metrics()

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    finished = sum(moved("toolkit:request_success_total", (("finished_reason", r),)) for r in ("length", "stop"))
    assert finished == 2  # one per sequence
    assert moved("toolkit:generation_tokens_total") == answer.usage.completion_tokens
    assert moved("toolkit:prompt_tokens_total") == answer.usage.prompt_tokens
    assert moved("toolkit:time_to_first_token_seconds_count") == 1
    assert moved("toolkit:e2e_request_latency_seconds_count") == 1
    assert moved("toolkit:prefix_cache_queries_total") > 0
    assert after[("toolkit:num_requests_running", ())] == 0 and after[("toolkit:kv_cache_usage_perc", ())] == 0
    assert not any(math.isnan(v) for v in after.values())


def test_a_compiled_server_builds_its_graphs_before_it_answers(ckpt):
    # `toolkit serve` runs one warm-up request before /health answers, so no client request waits for a
    # compile (the first ones did, for tens of seconds): the graph count is set at start and stays.
    server = Server(ckpt, "--dtype", "float32", "--max-model-len", MAX_MODEL_LEN, "--kv-cache-memory", "8MiB",
                    "--served-model-name", "tiny")
    try:
        graphs = server.metrics()[("toolkit:compiled_graphs", ())]
        assert graphs >= 1
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0)
        client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=9, temperature=0)
        assert server.metrics()[("toolkit:compiled_graphs", ())] == graphs
    finally:
        code, stderr = server.stop()
    assert code == 0, stderr[-4000:]


# --- overload and SIGTERM: a server with one slot and one waiting place ---------------------------------


LONG = 30_000  # tokens: a request that holds the one slot for many seconds (this model makes ~1000/s)


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    return write_tokenizer(write_checkpoint(tmp_path_factory.mktemp("llama"), "llama3", seed=3,
                                            max_position_embeddings=LONG + 64))


@pytest.fixture(scope="module")
def small_server(long_ckpt):
    server = Server(long_ckpt, "--eager", "--dtype", "float32", "--kv-cache-memory", "24MiB", "--max-num-seqs", 1,
                    "--max-waiting", 1, "--shutdown-timeout", 60)
    yield server
    server.stop()


def _start_stream(server, max_tokens: int) -> tuple:
    body = {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    ctx = httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120)
    response = ctx.__enter__()
    return ctx, response


def _wait_for(server, name: str, value: float) -> None:
    deadline = time.monotonic() + 30
    while server.metrics()[(name, ())] != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}: {server.metrics()}"
        time.sleep(0.05)


def test_overload_is_503_and_the_server_keeps_serving(small_server, long_ckpt):
    ctx_a, a = _start_stream(small_server, LONG)
    a_lines = a.iter_lines()  # kept: a dropped iterator closes the response, which aborts A
    first = next(a_lines)  # A holds the one slot
    # B takes the one waiting place; its answer starts once it runs, so it is asked from a thread.
    b_result = []
    b = threading.Thread(target=lambda: b_result.append(httpx.post(
        f"{small_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True}, timeout=120)))
    b.start()
    try:
        _wait_for(small_server, "toolkit:num_requests_waiting", 1)
        r = httpx.post(f"{small_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded", r.text
        with pytest.raises(openai.APIStatusError) as e:
            openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="none", max_retries=0).completions.create(
                model=str(long_ckpt), prompt="hi", max_tokens=2)
        assert e.value.status_code == 503
        assert first.startswith("data: ")
    finally:
        ctx_a.__exit__(None, None, None)  # A goes away: B runs
        b.join(120)
    assert b_result[0].status_code == 200 and b_result[0].json()["choices"][0]["finish_reason"] == "length"
    refused = small_server.metrics()[("toolkit:requests_refused_total", (("reason", "overloaded"),))]
    assert refused == 2
    _wait_for(small_server, "toolkit:kv_cache_usage_perc", 0)
    r = httpx.post(f"{small_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_sigterm_finishes_in_flight_requests_refuses_new_ones_and_exits_0(small_server):
    ctx, stream = _start_stream(small_server, 200)
    lines = stream.iter_lines()
    assert next(lines).startswith("data: ")
    small_server.proc.send_signal(15)
    rest = [line for line in lines if line]
    ctx.__exit__(None, None, None)
    assert rest[-1] == "data: [DONE]"  # finished, not cut off: --shutdown-timeout 60 leaves it time
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    code, stderr = small_server.stop()
    assert code == 0, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{small_server.url}/health", timeout=2)


def test_the_serving_bench_client_counts_every_token(server):
    """`toolkit bench serve`'s client (cli/bench/serving.py) against this server: every request's chunks
    add up to its output length, one timing point per token (no timing is judged here)."""
    from toolkit.cli.bench.serving import poisson_arrivals, run_clients, serving_metrics
    from toolkit.cli.bench.workload import random_workload

    requests = random_workload(6, (3, 20), (2, 9), vocab_size=300, seed=4)
    timings, duration = asyncio.run(run_clients(server.url, "tiny", requests, poisson_arrivals(6, 50.0, seed=4), 3))
    assert [t.output_len for t in timings] == [r.output_len for r in requests]
    assert all(len(t.chunks) == t.output_len for t in timings)
    out = serving_metrics(timings, duration, {})
    assert out["completed"] == 6 and out["failed"] == 0 and out["good_requests"] == 6


def test_bench_serve_command_against_a_running_server_writes_its_report(server, ckpt, tmp_path):
    from typer.testing import CliRunner

    from toolkit.cli.main import app

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "serve", "-m", str(ckpt), "--url", server.url, "--served-model-name",
                                      "tiny", "--num-requests", "3", "--input-len", "4", "8", "--output-len", "2", "4",
                                      "--request-rate", "inf", "--request-rate", "20", "--goodput", "e2el:60000",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [r["request_rate"] for r in report["runs"]] == [math.inf, 20.0]
    assert all(r["completed"] == 3 and r["failed"] == 0 and r["good_requests"] == 3 for r in report["runs"])
    assert all(r["output_tokens"] == report["runs"][0]["output_tokens"] for r in report["runs"])
    assert result.stderr.count("given @") == 2
