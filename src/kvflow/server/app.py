"""The OpenAI-compatible HTTP server: FastAPI routes over an EngineLoop.

    GET  /health                 liveness (no API key)
    GET  /v1/models              the one served model (``--served-model-name``, default the ``--model`` given)
    GET  /metrics                Prometheus text (TTFT / inter-token histograms, queue, blocks, hits, pool)
    POST /v1/completions         prompt as text or token ids (one or several), streaming (SSE) or not
    POST /v1/chat/completions    messages through the checkpoint's chat template or the byte-level fallback
    POST /tokenize, /detokenize  text <-> token ids with the served tokenizer (vLLM's extension; its benchmark
                                 client aligns its prompts with them)

Streams follow vLLM's: a chat stream's first chunk (role "assistant") is sent with the first token, so a client's
time to first token is the server's; ``stream_options.include_usage`` adds a last chunk with ``usage``.

Every failure is an OpenAI-style JSON error ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
request (malformed JSON, bad field, bad sampling value, prompt longer than the context, a limit of ``server:``
exceeded: protocol.py), 413 for a body over ``server.max_body_bytes``, 401 for a wrong API key, 404 for an unknown
model, 503 while shutting down, 500 if the engine fails — and the server keeps serving. A request that fails inside
a step ends alone (finish_reason "error", engine.py); a client that goes away, streaming or not, aborts its request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.engine import LLMEngine
from kvflow.engine.engine import RequestOutput
from kvflow.errors import KVFlowError
from kvflow.server.limits import ServerLimits
from kvflow.server.loop import EngineLoop, ServerBusy
from kvflow.server.metrics import ServerMetrics
from kvflow.server.protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                    parse_body, too_large, validate)

log = logging.getLogger("kvflow.server")
DEFAULT_MAX_TOKENS = 16
DISCONNECT_POLL_S = 0.25      # how often a non-streaming request checks that its client is still there


class BearerAuth:
    """Every route but /health wants ``Authorization: Bearer KEY`` (the scheme in any case, RFC 7235; white space
    around the key is not part of it, RFC 9110 §5.5). A plain ASGI middleware: it hands the route the server's own
    ``receive``, so a handler can still see its client go away."""

    def __init__(self, app, api_key: str, metrics: ServerMetrics):
        self.app, self.key, self.metrics = app, api_key.encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = header.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(given.strip(), self.key):
                self.metrics.responses.labels(_route(scope["path"]), "401").inc()
                err = APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ClientGone(Exception):
    """The client of a non-streaming request went away: its request was aborted."""


def build_app(engine: LLMEngine, model_name: str, tokenizer, *, api_key: str | None = None,
              drain_timeout_s: float = 30.0, limits: ServerLimits | None = None) -> FastAPI:
    limits = limits or ServerLimits()
    state: dict = {}
    metrics = ServerMetrics(engine, lambda: state.get("loop"))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = EngineLoop(engine, metrics).start()
        state["loop"] = app.state.engine_loop = loop
        try:
            yield
        finally:
            await asyncio.to_thread(loop.shutdown, drain_timeout_s)

    app = FastAPI(title="kvflow", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        metrics.responses.labels(_route(request.url.path), str(err.status)).inc()
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        """Unknown route (404), wrong method (405): the same JSON error shape as every other answer."""
        metrics.responses.labels(_route(request.url.path), str(err.status_code)).inc()
        return APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        log.exception("unexpected error on %s", request.url.path)
        metrics.responses.labels(_route(request.url.path), "500").inc()
        return APIError(500, f"internal error: {type(err).__name__}", "server_error").response()

    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key, metrics=metrics)

    async def read_body(request: Request) -> bytes:
        """The body, refused (413) as soon as it passes the limit: an oversized upload is never held whole."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise too_large(limits)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise too_large(limits)
            chunks.append(chunk)
        return b"".join(chunks)

    def served(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"model {name!r} does not exist (this server serves {model_name!r})",
                           param="model", code="model_not_found")

    async def parse(request: Request, cls):
        body = parse_body(await read_body(request), limits)
        req = validate(cls, body, limits)
        served(req.model)
        if req.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        return req

    def sampling(req, max_tokens: int | None):
        try:
            params = req.sampling(DEFAULT_MAX_TOKENS)
            if max_tokens is not None:
                params.max_tokens = max_tokens
                params.validate()
        except KVFlowError as err:
            raise APIError(400, str(err)) from None
        return params

    def check(ids: list[int], params) -> None:
        try:
            engine.check_prompt(ids, params)
        except KVFlowError as err:
            raise APIError(400, str(err), param="prompt") from None

    def submit(ids, params):
        try:
            return state["loop"].submit(ids, params)
        except ServerBusy as err:
            raise APIError(503, str(err), "server_error") from None

    async def events(handle):
        """RequestOutputs of one request until it finishes; aborts it if the client goes away."""
        done = False
        try:
            while not done:
                item = await handle.events.get()
                if isinstance(item, ClientGone):
                    raise item
                if isinstance(item, KVFlowError):
                    raise APIError(400, str(item))
                if isinstance(item, Exception):
                    raise APIError(500, f"engine error: {type(item).__name__}: {item}", "server_error")
                if item.error is not None:
                    raise APIError(500, f"request failed: {item.error}", "server_error")
                done = item.finished
                yield item
        finally:
            if not done:
                state["loop"].abort(handle)

    async def watch(request: Request, handles) -> None:
        """Until cancelled: when the client of a non-streaming request goes away, abort its requests. (Streaming
        responses need no watcher: Starlette cancels their generator, and ``events`` aborts.)"""
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        for handle in handles:
            state["loop"].abort(handle)
            handle.events.put_nowait(ClientGone())

    async def collect_all(request: Request, handles) -> list[tuple[str, list[int], RequestOutput]]:
        """Text, token ids and the last output of each request, run to its end; the others are aborted when one
        fails, all of them when the client goes away."""
        watcher = asyncio.create_task(watch(request, handles))
        done: list[tuple[str, list[int], RequestOutput]] = []
        try:
            for handle in handles:
                text, ids, last = [], [], None
                async for out in events(handle):
                    text.append(out.text_delta)
                    ids.extend(out.new_token_ids)
                    last = out
                done.append(("".join(text), ids, last))
        except ClientGone:
            raise APIError(499, "client closed the request", code="client_closed") from None
        finally:
            watcher.cancel()
            for handle in handles[len(done) + 1:]:
                state["loop"].abort(handle)
        return done

    async def tokenize(fn, *args) -> list:
        """Tokenizer work off the event loop: a long prompt must not stall /health and the other requests."""
        return await asyncio.to_thread(fn, *args)

    def usage(out: RequestOutput) -> dict:
        return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                "total_tokens": out.prompt_tokens + out.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}

    # ------------------------------------------------------------------------------------- routes
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "kvflow", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        prompts = await tokenize(_prompts, req.prompt, tokenizer)
        params = sampling(req, None)
        for ids in prompts:
            check(ids, params)
        if req.stream and len(prompts) != 1:
            raise APIError(400, "streaming takes one prompt per request", param="prompt")
        rid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        handles = [submit(ids, params) for ids in prompts]
        if req.stream:
            return _sse(_stream_completion(events(handles[0]), rid, created, model_name, req.include_usage, usage))
        done = await collect_all(request, handles)
        choices = [{"index": i, "text": text, "token_ids": ids, "logprobs": None, "finish_reason": last.finish_reason}
                   for i, (text, ids, last) in enumerate(done)]
        parts = [usage(last) for _, _, last in done]
        total = {k: sum(u[k] for u in parts) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        total["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"]
                                                               for u in parts)}
        metrics.responses.labels(_route(request.url.path), "200").inc()
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": total}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatRequest)
        ids = await tokenize(tokenizer.chat, [{"role": m.role, "content": m.text()} for m in req.messages])
        params = sampling(req, req.max_completion_tokens)
        check(ids, params)
        rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        handle = submit(ids, params)
        if req.stream:
            return _sse(_stream_chat(events(handle), rid, created, model_name, req.include_usage, usage))
        [(text, tokens, last)] = await collect_all(request, [handle])
        metrics.responses.labels(_route(request.url.path), "200").inc()
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "token_ids": tokens,
                             "logprobs": None, "finish_reason": last.finish_reason}],
                "usage": usage(last)}

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        req = validate(TokenizeRequest, parse_body(await read_body(request), limits), limits)
        served(req.model)
        if req.messages is not None:
            ids = await tokenize(tokenizer.chat, [{"role": m.role, "content": m.text()} for m in req.messages])
        else:
            ids = await tokenize(tokenizer.encode, req.prompt, req.add_special_tokens)
        metrics.responses.labels(_route(request.url.path), "200").inc()
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        req = validate(DetokenizeRequest, parse_body(await read_body(request), limits), limits)
        served(req.model)
        vocab = engine.runner.config.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        text = await tokenize(tokenizer.decode, req.tokens)
        metrics.responses.labels(_route(request.url.path), "200").inc()
        return {"prompt": text}

    return app


ROUTES = ("/health", "/v1/models", "/metrics", "/v1/completions", "/v1/chat/completions", "/tokenize",
          "/detokenize")


def _route(path: str) -> str:
    """The metrics label of a request's path: a served route, else "other" (any path a client makes up must not
    become a label of its own)."""
    return path if path in ROUTES else "other"


def _prompts(prompt, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def _sse(gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _data(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream_completion(outputs, rid, created, model, include_usage, usage):
    last = None
    try:
        async for out in outputs:
            last = out
            yield _data({"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": [{"index": 0, "text": out.text_delta, "token_ids": out.new_token_ids,
                                      "logprobs": None, "finish_reason": out.finish_reason}]})
    except APIError as err:
        yield _data(err.body())
    if include_usage and last is not None:
        yield _data({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                     "usage": usage(last)})
    yield "data: [DONE]\n\n"


async def _stream_chat(outputs, rid, created, model, include_usage, usage):
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    last = None
    try:
        async for out in outputs:
            if last is None:            # the role chunk goes with the first token, as vLLM's does
                yield _data({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})
            last = out
            yield _data({**head, "choices": [{"index": 0, "delta": {"content": out.text_delta},
                                              "token_ids": out.new_token_ids, "logprobs": None,
                                              "finish_reason": out.finish_reason}]})
    except APIError as err:
        yield _data(err.body())
    if include_usage and last is not None:
        yield _data({**head, "choices": [], "usage": usage(last)})
    yield "data: [DONE]\n\n"
