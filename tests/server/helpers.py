import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import httpx

from kvflow.engine import EngineConfig, LLMEngine
from kvflow.engine.tokenizer import ByteTokenizer
from kvflow.server import build_app
from kvflow.supervisor import Supervised, http_ready

MODEL = "tiny"
ROOT = Path(__file__).resolve().parents[2]


def kvflow_serve(cfg_path: Path, port: int, log_path: Path, *options: str, model: str = MODEL) -> Supervised:
    """`kvflow serve --model MODEL --config CFG [OPTIONS]` on ``port``, not started: a Supervised process, ready on
    /health."""
    return Supervised([sys.executable, "-m", "kvflow", "serve", "--model", model, "--config", str(cfg_path),
                       "--port", str(port), "--log-level", "warning", *options], log_path=log_path, cwd=ROOT,
                      env={**os.environ, "KVFLOW_TORCH_THREADS": "1"}, name="kvflow serve", poll_s=0.1,
                      ready=http_ready(f"http://127.0.0.1:{port}/health", timeout_s=1))


def wait_healthy(port: int, timeout: float = 90.0) -> None:
    """Until a server in this process (a uvicorn thread) answers /health."""
    ready, deadline = http_ready(f"http://127.0.0.1:{port}/health", timeout_s=1), time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.1)


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


def fail_first_step(engine) -> None:
    """The engine's next step raises (RuntimeError "boom"); every later step runs as usual."""
    real, calls = engine.batch_runner.execute, {"n": 0}

    def flaky(items):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(items)
    engine.batch_runner.execute = flaky


def run(coro):
    return asyncio.run(coro)


def sse_events(text: str) -> list:
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
