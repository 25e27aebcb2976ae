"""From a model name and a config file to a running server: model, tokenizer, engine (+ pool tier), app, uvicorn.

Config file (YAML/TOML), every section optional::

    engine:  {block_size: 16, kv_budget: 64M, max_num_batched_tokens: 512, strategy: cacheflow, ...}
    pool:    {devices: [...], chunk_tokens: 256, ...}      # present: the pool is the tier below resident blocks
    server:  {max_body_bytes: 32M, max_json_depth: 32, max_messages: 1024, max_prompts: 64}   # server/limits.py

No config file at all (``kvflow serve`` with no options): the embedded defaults below — the real ``smollm2-135m``
(model/catalog.py, converted once), EngineConfig's defaults with the resident KV sized to the model and the machine
(``kv_budget: auto``, engine/reserve.py), and a pool on this machine's disk under ``./.kvflow/`` (one extent file and
its index, kept across restarts) sized to the model (``default_pool_capacity``). A config file that leaves
``engine.kv_budget`` out gets ``auto`` too; EngineConfig() in code keeps its fixed 256 MiB (tests, the library).
"""

from __future__ import annotations

import logging
import os
import shutil
import time

from kvflow.config import read_file
from kvflow.engine import EngineConfig, LLMEngine
from kvflow.engine.config import AUTO       # "auto": sized to the model (KV budget, pool capacity)
from kvflow.engine.tokenizer import load_tokenizer
from kvflow.errors import ConfigError
from kvflow.model import catalog
from kvflow.server.limits import ServerLimits

log = logging.getLogger("kvflow.server")

DEFAULT_MODEL = catalog.DEFAULT  # the real model (model/catalog.py): smollm2-135m, converted once
DEFAULT_HOME = ".kvflow"         # in the current directory
DEFAULT_CHUNK_TOKENS = 64        # pool chunk: a chat history is reused in 64-token steps
POOL_CONTEXTS = 8                # the default pool holds this many of the model's full contexts (at most 32K tokens)...
POOL_BOUNDS = (2**30, 8 * 2**30)  # ... within 1-8 GiB ...
POOL_DISK_SHARE = 0.1            # ... and a tenth of the free disk at most


def default_config(home: str | os.PathLike = DEFAULT_HOME, capacity: int | str = AUTO) -> dict:
    """The config ``kvflow serve`` runs on without ``--config``: the ``engine:`` defaults (``kv_budget: auto``) and a
    pool of one extent file ``HOME/pool/kv.img`` (+ ``HOME/pool/index``), O_DIRECT where the file system allows it;
    ``capacity`` ``auto``: sized when the model is known (``default_pool_capacity``)."""
    from pathlib import Path

    from kvflow.pool.devices import odirect_supported

    root = Path(home).resolve() / "pool"
    root.mkdir(parents=True, exist_ok=True)
    return {"engine": {"kv_budget": AUTO},
            "pool": {"chunk_tokens": DEFAULT_CHUNK_TOKENS, "durability": "relaxed", "index_dir": str(root / "index"),
                     "devices": [{"type": "extent", "path": str(root / "kv.img"), "capacity": capacity,
                                  "direct": odirect_supported(root)}]}}


def default_pool_capacity(runner, path: os.PathLike) -> int | None:
    """The default pool's bytes for ``runner``: POOL_CONTEXTS of its contexts' KV within POOL_BOUNDS and at most
    POOL_DISK_SHARE of the free disk under ``path`` (whole MiB); None when the file exists (it keeps the size it was
    made with)."""
    from pathlib import Path

    path = Path(path)
    if path.exists():
        return None
    free = shutil.disk_usage(path.parent).free
    contexts = POOL_CONTEXTS * min(runner.max_positions or 32768, 32768) * runner.kv_bytes_per_token()
    want = min(max(contexts, POOL_BOUNDS[0]), POOL_BOUNDS[1], int(free * POOL_DISK_SHARE))
    return max(want >> 20, 1) << 20


def _resolve_pool(data: dict, runner) -> dict:
    """``data`` with every ``capacity: auto`` pool device sized by ``default_pool_capacity`` (logged)."""
    pool = dict(data["pool"])
    devices = []
    for dev in pool.get("devices") or []:
        if isinstance(dev, dict) and dev.get("capacity") == AUTO:
            dev = {k: v for k, v in dev.items() if k != "capacity"}
            capacity = default_pool_capacity(runner, dev["path"])
            if capacity is not None:
                dev["capacity"] = capacity
            log.info("pool %s: %s", dev["path"], "existing file, its own size" if capacity is None else
                     f"{capacity / 2**30:.2f} GiB ({POOL_CONTEXTS} contexts of {runner.name}'s KV within "
                     f"{POOL_BOUNDS[0] >> 30}-{POOL_BOUNDS[1] >> 30} GiB and {POOL_DISK_SHARE:.0%} of the free disk)")
        devices.append(dev)
    return {**data, "pool": {**pool, "devices": devices}}


def build_engine(model: str, config: str | dict | None = None, *, seed: int = 0, cost=None,
                 elastic_reserve: bool = False):
    """(engine, tokenizer) for ``model`` with the ``engine:`` (and optional ``pool:``) sections of ``config`` (a file,
    or a mapping such as ``default_config()``); ``elastic_reserve`` turns engine.elastic_reserve on."""
    from kvflow import KVPool, Restorer, load_model

    data = read_config(config)
    engine_cfg = EngineConfig.load({"engine": {"kv_budget": AUTO, **(data.get("engine") or {})}})
    if elastic_reserve:
        engine_cfg.elastic_reserve = True
    if engine_cfg.holds_to_live_set:
        from kvflow.model.host_memory import hold_to_live_set
        hold_to_live_set()          # before the model loads: its heap holes are not left for served steps to reuse
    runner = load_model(model, seed=seed)
    tokenizer = load_tokenizer(model, runner.config.vocab_size)
    restorer = None
    if "pool" in data:
        pool = KVPool.open(_resolve_pool(data, runner) if isinstance(config, dict) else config)
        restorer = Restorer(runner, pool, cost=cost)
    return LLMEngine(runner, engine_cfg, restorer=restorer, tokenizer=tokenizer), tokenizer


def serve(model: str = DEFAULT_MODEL, config: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, seed: int = 0, log_level: str = "info", elastic_reserve: bool = False,
          served_model_name: str | None = None) -> None:
    """Serve until SIGINT / SIGTERM; without ``config`` on the embedded defaults (pool under ./.kvflow/).
    Clients name the model ``served_model_name`` (default: ``model`` as given)."""
    import uvicorn

    from kvflow.server.app import build_app
    from kvflow.threads import in_fresh_thread

    began = time.perf_counter()
    api_key = check_api_key(api_key if api_key is not None else os.environ.get("KVFLOW_API_KEY"))
    name = check_served_name(model if served_model_name is None else served_model_name)
    limits = ServerLimits.load({"server": read_config(config).get("server") or {}})
    # built on a thread that ends here: the main thread (uvicorn's) keeps no OpenMP team beside the engine thread's
    engine, tokenizer = in_fresh_thread(build_engine, model, config or default_config(), seed=seed,
                                        elastic_reserve=elastic_reserve)
    app = build_app(engine, name, tokenizer, api_key=api_key, limits=limits)
    log.info("serving %s as %r on http://%s:%d (%d KV blocks of %d tokens, pool %s, API key %s), built in %.1f s",
             model, name, host, port, engine.num_blocks, engine.config.block_size, "on" if engine.pool else "off",
             "required" if api_key else "off", time.perf_counter() - began)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)


SECTIONS = ("engine", "pool", "server")


def read_config(config: str | dict | None) -> dict:
    """A server config (a file or a mapping) with only known sections, each a mapping; ConfigError otherwise."""
    data = config if isinstance(config, dict) else read_file(config) if config else {}
    where = "config" if isinstance(config, dict) else str(config)
    for name, section in data.items():
        if name not in SECTIONS:
            raise ConfigError(f"{where}: unknown section {str(name)!r} (known: {', '.join(SECTIONS)})")
        if section is not None and not isinstance(section, dict):
            raise ConfigError(f"{where}: section {name!r} must be a mapping, got {type(section).__name__}")
    return data


def check_served_name(name: str) -> str:
    """The model name clients send (``--served-model-name``): not empty, no white space at either end, no control
    characters (it goes into every answer and log line as given)."""
    if not name.strip() or name != name.strip() or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ConfigError(f"--served-model-name {name!r}: give a non-empty name without control characters or white "
                          "space at either end")
    return name


def check_api_key(key: str | None) -> str | None:
    """``--api-key`` / ``KVFLOW_API_KEY`` as given; an empty or blank key is an error, not authentication turned off
    without a word (leave the option out to serve without a key), and so is one with white space at either end (HTTP
    drops it from the header, so no client could ever match it)."""
    if key is None:
        return None
    if not key.strip():
        raise ConfigError("--api-key / KVFLOW_API_KEY is empty: give a key, or leave both unset to serve without one")
    if key != key.strip():
        raise ConfigError("--api-key / KVFLOW_API_KEY has white space at its start or end; no client could send it")
    return key
