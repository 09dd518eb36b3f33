"""The HTTP routes (FastAPI): OpenAI's completions, chat completions and models, vLLM's /tokenize and
/detokenize, /health and /metrics.

A request's prompts are checked and tokenized here, on the event loop, then handed to the engine
thread (engine_loop.py); the handler reads their updates from an asyncio queue. The response starts
only once the engine has answered something (a first token, or a refusal such as a request the KV
cache can never hold), so a refusal is still a 400 JSON error, streamed or not. A client that goes
away aborts its requests, which frees their KV blocks at once. Every error the client sees is
OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`; a bug is a 500 in that
shape (logged here with its traceback), never a traceback to the client, and the server goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response as HTTPResponse, StreamingResponse
from starlette.exceptions import HTTPException

from toolkit.server.engine_loop import EngineLoop, NewRequest, Overloaded, Stream
from toolkit.server.metrics import CONTENT_TYPE, ServerMetrics, engine_snapshot
from toolkit.server.protocol import Front, RequestError, parse
from toolkit.server.responses import Response

log = logging.getLogger("toolkit")


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


def build_app(loop: EngineLoop, front: Front, metrics: ServerMetrics) -> FastAPI:
    app = FastAPI(title="toolkit", docs_url=None, redoc_url=None, openapi_url=None)
    _error_handlers(app, metrics)

    @app.get("/health")
    async def health():
        if not loop.alive:
            raise RequestError("the engine has stopped", status=503, kind="service_unavailable")
        return HTTPResponse(status_code=200)

    @app.get("/v1/models")
    async def models():
        card = {"id": front.model_name, "object": "model", "created": int(time.time()), "owned_by": "toolkit",
                "root": str(front.engine.config.model), "max_model_len": front.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus():
        snapshot = await asyncio.wrap_future(_on_engine(loop, lambda engine: engine_snapshot(
            engine, loop.kv_blocks, loop.router.routed if loop.router else None)))
        return HTTPResponse(metrics.exposition(snapshot), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json(request)
        if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
            raise RequestError("/tokenize takes an object with a prompt or messages")
        front.check_model(body)
        if "prompt" in body:
            if not isinstance(body["prompt"], str):
                raise RequestError("prompt must be a string", param="prompt")
            front.need_tokenizer()
            tokens = front.tokenizer(body["prompt"])["input_ids"]
        else:
            tokens = parse({"messages": body["messages"], "max_tokens": 1}, "chat", front).prompts[0].token_ids
        return {"count": len(tokens), "max_model_len": front.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise RequestError("/detokenize takes an object with tokens, a list of token ids", param="tokens")
        front.need_tokenizer()
        return {"prompt": front.tokenizer.decode(tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, "completion", loop, front, metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, "chat", loop, front, metrics)

    return app


def _error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError):
        metrics.refused.labels(reason="overloaded" if e.status == 503 else "invalid").inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown route, wrong method, ...
        return JSONResponse(RequestError(str(e.detail), status=e.status_code).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(RequestError(str(e)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        error = RequestError(f"internal error: {type(e).__name__}: {e}", status=500, kind="server_error")
        return JSONResponse(error.body(), status_code=500)


async def _json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None


def _on_engine(loop: EngineLoop, fn):
    if not loop.alive:
        raise RequestError("the engine has stopped", status=503, kind="service_unavailable")
    return loop.call(fn)


async def _generate(request: Request, kind: str, loop: EngineLoop, front: Front, metrics: ServerMetrics):
    parsed = parse(await _json(request), kind, front)
    if not loop.alive:
        raise RequestError("the engine has stopped", status=503, kind="service_unavailable")
    response = Response(parsed, front.tokenizer)
    updates: asyncio.Queue = asyncio.Queue()
    ids = [f"{response.id}-{p}" for p in range(len(parsed.prompts))]
    running = set()
    try:
        for p, (request_id, prompt) in enumerate(zip(ids, parsed.prompts)):
            stream = Stream(asyncio.get_running_loop(), updates, p)
            loop.submit(NewRequest(request_id, prompt.token_ids, parsed.params, prompt.text), stream)
            running.add(p)
        first = await _unless_gone(request, updates.get())
        _raise_refusal(first)
    except Overloaded as e:
        _abort(loop, ids, running)
        raise RequestError(str(e), status=503, kind="overloaded") from None
    except BaseException:  # a refusal, the client gone, the server stopping: nothing of it stays in the engine
        _abort(loop, ids, running)
        raise
    if not parsed.stream:
        try:
            finals = await _unless_gone(request, _finals(first, updates, running))
        finally:
            _abort(loop, ids, running)
        return JSONResponse(response.body(finals))
    return StreamingResponse(_events(first, updates, running, response, loop, ids), media_type="text/event-stream")


def _raise_refusal(update: tuple) -> None:
    _, u = update
    if u.error is not None:
        raise RequestError(u.error, status=u.status, kind="server_error" if u.status >= 500 else "invalid_request_error")


async def _unless_gone(request: Request, awaitable):
    """`awaitable`'s result, or ClientGone as soon as the client disconnects."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _finals(first: tuple, updates: asyncio.Queue, running: set) -> list:
    finals = {}
    update = first
    while True:
        p, u = update
        _raise_refusal(update)
        if u.final is not None:
            finals[p] = u.final
            running.discard(p)
            if not running:
                return [finals[i] for i in sorted(finals)]
        update = await updates.get()


async def _events(first: tuple, updates: asyncio.Queue, running: set, response: Response, loop: EngineLoop,
                  ids: list[str]):
    """Server-sent events: each update's chunks as they come, usage last when asked, then [DONE]."""
    try:
        for chunk in response.first_chunks():
            yield _sse(chunk)
        update = first
        while True:
            p, u = update
            for delta in u.deltas:
                yield _sse(response.chunk(p, delta))
            if u.error is not None:  # too late for a status code: an error event ends the stream
                yield _sse(RequestError(u.error, status=u.status, kind="server_error").body())
                break
            if u.final is not None:
                running.discard(p)
                if not running:
                    break
            update = await updates.get()
        if response.parsed.include_usage:
            yield _sse(response.usage_chunk())
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away mid-stream (the response task is cancelled)
        _abort(loop, ids, running)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _abort(loop: EngineLoop, ids: list[str], running: set) -> None:
    for p in list(running):
        loop.abort(ids[p])
    running.clear()
