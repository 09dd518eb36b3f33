"""The server's engine thread (toolkit/server/engine_loop.py) in-process, on a tiny engine: the queue's
bound, an abort that arrives with its request, and a failing step that ends the loop."""

from __future__ import annotations

import asyncio

import pytest

from tests.checkpoints import write_checkpoint, write_tokenizer
from toolkit import LLM, SamplingParams
from toolkit.server.engine_loop import EngineLoop, NewRequest, Overloaded, Stream

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ckpt = write_tokenizer(write_checkpoint(tmp_path_factory.mktemp("llama"), "llama3", seed=3))
    return LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=128,
               kv_cache_memory_bytes=2 * 2**20).engine


def run_requests(loop: EngineLoop, requests: list[NewRequest], before_start=None) -> list:
    """Submit the requests, start the loop, and collect every update until each request ended."""

    async def main():
        updates: asyncio.Queue = asyncio.Queue()
        for i, request in enumerate(requests):
            loop.submit(request, Stream(asyncio.get_running_loop(), updates, i))
        if before_start is not None:
            before_start()
        loop.start()
        got, open_ = [], set(range(len(requests)))
        while open_:
            tag, update = await asyncio.wait_for(updates.get(), 60)
            got.append((tag, update))
            if update.final is not None or update.error is not None:
                open_.discard(tag)
        return got

    try:
        return asyncio.run(main())
    finally:
        loop.stop(timeout=30)


def test_waiting_sequences_are_bounded_by_max_waiting(engine):
    loop = EngineLoop(engine, max_waiting=2)
    with pytest.raises(Overloaded, match="--max-waiting is 2"):
        loop.submit(NewRequest("a", [5, 6], SamplingParams(n=3)), stream=None)
    loop.submit(NewRequest("b", [5, 6], SamplingParams(n=2)), stream=None)
    with pytest.raises(Overloaded):  # b's two sequences are queued for the next turn
        loop.submit(NewRequest("c", [5, 6], SamplingParams()), stream=None)


def test_an_abort_that_arrives_with_its_request_ends_it_with_no_block_held(engine):
    loop = EngineLoop(engine, max_waiting=8)
    keep = NewRequest("keep", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
    gone = NewRequest("gone", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, n=2))
    updates = run_requests(loop, [keep, gone], before_start=lambda: loop.abort("gone"))
    finals = {tag: u.final for tag, u in updates if u.final is not None}
    assert [s.finish_reason for s in finals[1].outputs] == ["abort", "abort"]
    assert len(finals[0].outputs[0].token_ids) == 4
    # What was streamed adds up to the final output.
    assert [t for tag, u in updates if tag == 0 for d in u.deltas for t in d.token_ids] == finals[0].outputs[0].token_ids
    assert engine.scheduler.num_free_blocks == engine.scheduler.kv_cache.num_blocks


def test_a_failing_step_tells_its_requests_and_stops_the_server(engine, monkeypatch):
    failures = []
    loop = EngineLoop(engine, max_waiting=8, on_failure=lambda: failures.append(True))

    def broken_step():
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", broken_step)
    request = NewRequest("r", [5, 6, 7], SamplingParams(max_tokens=4))
    [(_, update)] = run_requests(loop, [request])
    assert update.status == 500 and "RuntimeError: boom" in update.error
    assert not loop.alive and failures == [True] and isinstance(loop.failure, RuntimeError)
    engine.abort_request("r")  # leave the module's engine empty
