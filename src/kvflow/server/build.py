"""From a model name and a config file to a running server: model, tokenizer, engine (+ pool tier), app, uvicorn.

Config file (YAML/TOML), every section optional::

    engine:  {block_size: 16, kv_budget: 64M, max_num_batched_tokens: 512, strategy: cacheflow, ...}
    pool:    {devices: [...], chunk_tokens: 256, ...}      # present: the pool is the tier below resident blocks
"""

from __future__ import annotations

import logging
import os

from kvflow.config import read_file
from kvflow.engine import EngineConfig, LLMEngine
from kvflow.engine.tokenizer import load_tokenizer

log = logging.getLogger("kvflow.server")


def build_engine(model: str, config: str | None = None, *, seed: int = 0, cost=None):
    """(engine, tokenizer) for ``model`` with the ``engine:`` (and optional ``pool:``) sections of ``config``."""
    from kvflow import KVPool, Restorer, load_model

    data = read_file(config) if config else {}
    engine_cfg = EngineConfig.load(data)
    runner = load_model(model, seed=seed)
    tokenizer = load_tokenizer(model, runner.config.vocab_size)
    restorer = None
    if "pool" in data:
        restorer = Restorer(runner, KVPool.open(config), cost=cost)
    return LLMEngine(runner, engine_cfg, restorer=restorer, tokenizer=tokenizer), tokenizer


def serve(model: str, config: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, seed: int = 0, log_level: str = "info") -> None:
    import uvicorn

    from kvflow.server.app import build_app

    engine, tokenizer = build_engine(model, config, seed=seed)
    api_key = api_key or os.environ.get("KVFLOW_API_KEY") or None
    app = build_app(engine, model, tokenizer, api_key=api_key)
    log.info("serving %s on http://%s:%d (%d KV blocks of %d tokens, pool %s)", model, host, port,
             engine.num_blocks, engine.config.block_size, "on" if engine.pool else "off")
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)
