"""ServerProcess: a kvflow server in a process of its own, on 127.0.0.1 (the demo's and each benchmark
configuration's), and the engine it runs (``kvflow_engine``: a fresh pool per configuration).

Why a process and not a thread of the benchmark: the load generator is Python too (asyncio, the OpenAI client,
SSE parsing for every streamed token of every user), and in one process it shares a GIL with the server's HTTP
loop and the engine loop it measures. The peer (vLLM) runs in its own processes, so a kvflow server in the
client's process would be measured with a handicap the peer does not have. Measured on this machine (``tiny``,
8 users x 12 turns, 3-4K-token histories): decode steps of a served 2 x 3.6K batch took 8.4 ms in the client's
process against ~5 ms alone.

    with ServerProcess(partial(engine_for, "tiny", 0, strategy="cacheflow", ...), "tiny") as server:
        run_chat(server.url, ...); server.hit_split(); server.finished(); server.pid

The engine is built in the child by ``build`` (a picklable zero-argument callable returning an LLMEngine, or an
(engine, tokenizer) pair as ``server.build_engine`` does): the parent passes what it measured (the cost model, the
recompute rate), never a model. The child answers the parent over a pipe; a failure while building or starting is
one KVFlowError in the parent with the child's reason. On exit the server drains, the engine's pool writes are
flushed and its pool closed, then the process ends (killed after a deadline, never left running).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from typing import Callable

from kvflow.errors import KVFlowError
from kvflow.net import free_port
from kvflow.supervisor import stop_group

START_TIMEOUT_S = 300.0     # model load + activation-reserve probe + pool open
STOP_TIMEOUT_S = 120.0


def engine_for(model: str, seed: int, **kwargs):
    """``kvflow_engine`` over ``model`` loaded here (the child) with its own tokenizer (a checkpoint's, else the
    byte-level fallback), its set-up on a thread that ends."""
    from kvflow import load_model
    from kvflow.engine.tokenizer import load_tokenizer
    from kvflow.threads import in_fresh_thread

    runner = in_fresh_thread(load_model, model, seed=seed)
    return in_fresh_thread(kvflow_engine, runner, tokenizer=load_tokenizer(model, runner.config.vocab_size),
                           **kwargs)


def fresh_pool(pool_bytes: int, chunk_tokens: int, pool_dir: str | None = None, name: str = "pool",
               rho: float | None = None, recompute_rate: float | None = None):
    """An empty pool: in memory, or one extent file (+ index) under ``pool_dir`` (anything there before is removed);
    with ``rho`` throttled to rho x ``recompute_rate`` (KV bytes/s of short-context recompute, measured warm at the
    start of the run: bench/bound.py, as every kvflow benchmark defines rho — DESIGN.md §5)."""
    import shutil
    from pathlib import Path

    from kvflow import KVPool
    from kvflow.pool.devices import odirect_supported

    if pool_dir is None:
        pool = KVPool.memory(pool_bytes, chunk_tokens=chunk_tokens)
    else:
        root = Path(pool_dir) / f"serve-{name}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        pool = KVPool.open({"devices": [{"type": "extent", "path": str(root / "kv.img"), "capacity": pool_bytes,
                                         "direct": odirect_supported(root)}],
                            "chunk_tokens": chunk_tokens, "index_dir": str(root / "index"), "durability": "relaxed"})
    if rho is not None:
        pool.set_throttle(rho * recompute_rate)
    return pool


def kvflow_engine(runner, strategy: str | None, kv_budget: int, block_size: int, pool_bytes: int, chunk_tokens: int,
                  max_num_batched_tokens: int, cost=None, pool_dir: str | None = None, rho: float | None = None,
                  recompute_rate: float | None = None, scheduling_policy: str | None = None, tokenizer=None,
                  activation_reserve: int = 0, pool_load: bool = True):
    """An engine over ``runner`` with a fresh pool (``strategy`` None: no pool tier; ``scheduling_policy`` None:
    the engine's default; ``tokenizer`` None: the byte-level one; ``activation_reserve`` 0: measured;
    ``pool_load`` False: pool hits only restored by the strategy, for a comparison of strategies)."""
    from kvflow import Restorer
    from kvflow.engine import EngineConfig, LLMEngine
    from kvflow.engine.tokenizer import ByteTokenizer

    restorer = None
    if strategy is not None:
        pool = fresh_pool(pool_bytes, chunk_tokens, pool_dir, strategy, rho, recompute_rate)
        restorer = Restorer(runner, pool, cost=cost)
    cfg = EngineConfig(block_size=block_size, kv_budget=kv_budget, strategy=strategy or "cacheflow",
                       max_num_batched_tokens=max_num_batched_tokens, activation_reserve=activation_reserve,
                       pool_load=pool_load,
                       **({} if scheduling_policy is None else {"scheduling_policy": scheduling_policy}))
    cfg.validate()
    return LLMEngine(runner, cfg, restorer=restorer, tokenizer=tokenizer or ByteTokenizer(runner.config.vocab_size))


def hit_split(engine) -> dict:
    """Share of prompt tokens that were resident hits, pool hits and misses, the pool's counters and the spin
    governor's (kvflow/spin.py) switches and spinning share."""
    from kvflow import spin

    st = engine.stats
    total = st.resident_hit_tokens + st.pool_hit_tokens + st.miss_tokens
    return {"resident": st.resident_hit_tokens / total if total else 0.0,
            "pool": st.pool_hit_tokens / total if total else 0.0,
            "miss": st.miss_tokens / total if total else 0.0,
            "preemptions": st.preemptions, "swaps": st.swaps,
            "strategy_mix": dict(engine.pool.loaded_tokens) if engine.pool else {},
            "pool_counters": dict(engine.pool.counters) if engine.pool else {},
            "omp_spin": governor.stats() if (governor := spin.current()) is not None else None}


def _child(build: Callable, model: str, port: int, conn) -> None:
    """The server process: build, serve on ``port`` in a thread, answer the parent until it says stop."""
    import uvicorn

    from kvflow.server import build_app
    from kvflow.threads import in_fresh_thread

    os.setsid()                     # a group of its own: stopped as one (kvflow/supervisor.py)
    try:
        engine = in_fresh_thread(build)
        if isinstance(engine, tuple):
            engine = engine[0]
        app = build_app(engine, model, engine.tokenizer)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True, name="kvflow-bench-http")
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"uvicorn did not start on port {port}")
            time.sleep(0.02)
    except Exception as err:        # the parent raises it as one line
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", os.getpid()))
    try:
        while True:
            cmd = conn.recv()
            if cmd == "stats":
                conn.send(hit_split(engine))
            elif cmd == "finished":
                conn.send(engine.stats.finished)
            else:
                break
    except EOFError:                # the parent went away: stop too
        pass
    server.should_exit = True
    thread.join(timeout=STOP_TIMEOUT_S)
    engine.close()
    if engine.pool is not None:
        engine.pool.pool.close()
    try:
        conn.send(("stopped", hit_split(engine)))
    except (BrokenPipeError, OSError):
        pass


class ServerProcess:
    def __init__(self, build: Callable, model: str):
        self.build, self.model = build, model
        self.port = free_port()
        spawn = mp.get_context("spawn")
        self._conn, child = spawn.Pipe()
        self._proc = spawn.Process(target=_child, args=(build, model, self.port, child),
                                                      daemon=True, name=f"kvflow-bench-server-{self.port}")
        self._child_conn = child
        self._final: dict | None = None
        self.pid: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _ask(self, cmd: str):
        if self._final is not None:
            return self._final if cmd == "stats" else None
        self._conn.send(cmd)
        return self._conn.recv()

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def hit_split(self) -> dict:
        return self._ask("stats")

    def finished(self) -> int:
        """Requests the engine has finished so far (for progress bars)."""
        return self._ask("finished") or 0

    def __enter__(self) -> ServerProcess:
        self._proc.start()
        self._child_conn.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self._kill()
            raise KVFlowError(f"the benchmark server did not start within {START_TIMEOUT_S:.0f} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._kill()
            raise KVFlowError(f"the benchmark server exited while starting (exit code {self._proc.exitcode})") \
                from None
        if kind != "ready":
            self._kill()
            raise KVFlowError(f"the benchmark server did not start: {value}")
        self.pid = value
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._conn.send("stop")
            if self._conn.poll(STOP_TIMEOUT_S):
                kind, value = self._conn.recv()
                if kind == "stopped":
                    self._final = value
        except (EOFError, BrokenPipeError, OSError):
            pass
        self._proc.join(timeout=30)
        self._kill()

    def _kill(self) -> None:
        if self._proc.is_alive():
            stop_group(self._proc.pid, self._joined)

    def _joined(self, seconds: float) -> bool:
        self._proc.join(timeout=seconds)
        return not self._proc.is_alive()
