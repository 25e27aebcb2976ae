import asyncio
import contextlib
import json

import httpx

from kvflow.engine import EngineConfig, LLMEngine
from kvflow.engine.tokenizer import ByteTokenizer
from kvflow.server import build_app

MODEL = "tiny"


def make_app(runner, restorer=None, api_key=None, **cfg):
    engine = LLMEngine(runner, EngineConfig(**{"block_size": 8, "kv_budget": 8 << 20, **cfg}), restorer=restorer,
                       tokenizer=ByteTokenizer(runner.config.vocab_size))
    return build_app(engine, MODEL, engine.tokenizer, api_key=api_key), engine


@contextlib.asynccontextmanager
async def client(app, **kw):
    """An httpx client on the app in-process, its lifespan (engine loop) running for the block."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvflow", timeout=120, **kw) as c:
            yield c


def run(coro):
    return asyncio.run(coro)


def sse_events(text: str) -> list:
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
