"""Launch pipeline stages as processes, supervise them, collect their results.

    parent ─ writes the spec (model name + seed + fingerprint, pool config, cost model, contexts, runs) ─┐
           ├─ stage 0: python -m kvflow.pipeline.worker SPEC 0 ─┐                                        │
           ├─ stage 1: python -m kvflow.pipeline.worker SPEC 1 ─┤ gloo over 127.0.0.1, one torch thread  │
           └─ ...                                                ┘ each (configurable), own pool reader    │
           polls every 20 ms: all exited 0 -> read results; one died / failed / past the deadline -> SIGKILL
           the rest, raise one KVFlowError line naming the stage, its layers and what it was doing.

A run may use fewer stages than were launched (``--stages 1,2`` in one launch): the other ranks wait at the next
run's barrier, which costs no CPU. Stages never outlive the launcher (PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvflow.cost.model import CostModel
from kvflow.errors import KVFlowError
from kvflow.net import free_port
from kvflow.planner import PlannerConfig
from kvflow.planner.pipeline import MODES, STAGE_STRATEGIES

POLL_S = 0.02


@dataclass
class PipelineRun:
    """One restoration through the pipeline. ``stages``: contiguous layer ranges, one per stage; ``bandwidths``:
    each stage's own link in bytes/s (None: unthrottled)."""
    context: torch.Tensor | list[int]
    query: torch.Tensor | list[int]
    stages: list[tuple[int, int]]
    mode: str = "independent"            # independent | sequential
    bandwidths: list[float] | None = None
    strategy: str = "token"              # each stage's plan: token | cake | load
    handoff: str = "stage"               # sequential: hand over recomputed hidden states at once | per "step"
    return_kv: bool = False
    label: str = ""


@dataclass
class StageReport:
    stage: int
    layers: tuple[int, int]
    inputs: str
    mode: str
    label: str
    plan: str
    split: list[int]
    bandwidth: float
    act_chunks: int
    bound_s: float
    predicted_restore_s: float
    plan_s: float
    restore_s: float
    grid_compute_end_s: float
    compute_busy_s: float
    io_busy_s: float
    act_io_busy_s: float
    blocked_s: float
    recomputed_chunks: int
    loaded_chunks: int
    act_failed: list[int]
    fallback_chunks: list[int]
    complete_chunks: int
    num_chunks: int
    repaired: list[list[int]]
    query_start_s: float
    query_end_s: float
    ttft_s: float | None
    events: list[list]
    pipeline: dict | None = None


@dataclass
class PipelineResult:
    label: str
    mode: str
    stages: list[StageReport]
    ttft_s: float
    logits: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None    # every model layer, assembled from the stages
    lower_bound_s: float
    predicted_ttft_s: float
    plan: str
    balance: dict = field(default_factory=dict)


@dataclass
class Pipeline:
    """Stages of ``model`` (a preset name + seed or a checkpoint directory) reading ``pool`` (its config: every
    device must be one another process can open — memory with a ``path`` such as /dev/shm/..., or extent)."""
    model: str
    fingerprint: str
    pool: object                          # PoolConfig
    cost: CostModel
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"                   # stage g computes on cuda:g where each stage has a GPU (pipeline/comm.py)
    threads: int = 1                      # torch threads per stage
    timeout_s: float = 300.0              # whole launch; also every collective / receive
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    faults: dict | None = None            # tests: {"stage": g, "at": "run 0 restore", "action": "kill" | "hang"}
    keep_dir: str | None = None           # keep the spec, logs and results here

    def run(self, runs: list[PipelineRun], progress: Callable[[str], None] | None = None) -> list[PipelineResult]:
        """Launch max(len(run.stages)) stage processes, do every run in order, return one result per run.
        ``progress`` hears which run stage 0 is on."""
        if not runs:
            return []
        self._check(runs)
        world = max(len(r.stages) for r in runs)
        workdir = Path(self.keep_dir) if self.keep_dir else Path(tempfile.mkdtemp(prefix="kvflow-pipeline-"))
        workdir.mkdir(parents=True, exist_ok=True)
        contexts: list[list[int]] = []
        index: dict[tuple, int] = {}
        run_specs = []
        for run in runs:
            ctx = _ids(run.context)
            key = tuple(ctx)
            if key not in index:
                index[key] = len(contexts)
                contexts.append(ctx)
            run_specs.append({"context": index[key], "query": _ids(run.query),
                              "stages": [list(s) for s in run.stages], "mode": run.mode,
                              "bandwidths": None if run.bandwidths is None else [float(b) for b in run.bandwidths],
                              "strategy": run.strategy, "handoff": run.handoff, "return_kv": run.return_kv,
                              "label": run.label})
        spec = {"model": self.model, "seed": self.seed, "dtype": self.dtype, "device": self.device,
                "fingerprint": self.fingerprint,
                "pool": _pool_dict(self.pool), "cost": asdict(self.cost), "planner": asdict(self.planner),
                "threads": self.threads, "timeout_s": self.timeout_s, "world_size": world,
                "init_method": f"tcp://127.0.0.1:{free_port()}", "dir": str(workdir), "parent": os.getpid(),
                "faults": self.faults, "contexts": contexts, "runs": run_specs}
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        try:
            self._supervise(spec_path, workdir, world, runs, progress)
            return [self._collect(workdir, r, run) for r, run in enumerate(runs)]
        finally:
            if not self.keep_dir:
                for p in workdir.iterdir():
                    p.unlink()
                workdir.rmdir()

    # ------------------------------------------------------------------------------------------ internals
    def _check(self, runs: list[PipelineRun]) -> None:
        if self.threads < 1:
            raise KVFlowError("threads per stage must be >= 1")
        if any(d.path is None for d in self.pool.devices) or self.pool.index_dir is None:
            raise KVFlowError("pipeline stages are separate processes: the pool needs devices they can open (memory "
                              "with a path such as /dev/shm/kvflow0, or extent) and an index_dir")
        L = self.cost.num_layers
        for run in runs:
            s = [tuple(x) for x in run.stages]
            if not s or s[0][0] != 0 or s[-1][1] != L or any(a >= b for a, b in s) or \
                    any(p[1] != q[0] for p, q in zip(s, s[1:])):
                raise KVFlowError(f"stages {s} must be contiguous, non-empty layer ranges covering 0-{L - 1}")
            if run.mode not in MODES:
                raise KVFlowError(f"unknown pipeline mode {run.mode!r}: use {' or '.join(MODES)}")
            if run.strategy not in STAGE_STRATEGIES:
                raise KVFlowError(f"unknown stage strategy {run.strategy!r}: use {', '.join(STAGE_STRATEGIES)}")
            if run.handoff not in ("stage", "step"):
                raise KVFlowError(f"unknown hand-off {run.handoff!r}: use stage or step")
            if len(_ids(run.query)) == 0:
                raise KVFlowError("a pipeline run needs at least one query token")
            if run.bandwidths is not None and (len(run.bandwidths) != len(s) or min(run.bandwidths) <= 0):
                raise KVFlowError("bandwidths: one positive value (bytes/s) per stage")

    def _supervise(self, spec_path: Path, workdir: Path, world: int, runs: list[PipelineRun], progress) -> None:
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads),
                   KVFLOW_TORCH_THREADS=str(self.threads), PYTHONUNBUFFERED="1")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        procs = []
        for g in range(world):
            log = open(workdir / f"stage{g}.log", "wb")
            procs.append(subprocess.Popen([sys.executable, "-m", "kvflow.pipeline.worker", str(spec_path), str(g)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            log.close()
        deadline = time.monotonic() + self.timeout_s
        told = None
        try:
            while True:
                if progress is not None and (phase := _phase(workdir, 0)) != told:
                    told = phase
                    if phase.startswith("run ") and phase.endswith(" start"):
                        r = int(phase.split()[1])
                        progress(f"run {r + 1}/{len(runs)}: {runs[r].label or runs[r].mode}")
                codes = [p.poll() for p in procs]
                if all(c == 0 for c in codes):
                    return
                if any(c not in (None, 0) for c in codes):
                    time.sleep(0.2)            # let the peers of a dead stage notice, so the cause is clear
                    codes = [p.poll() for p in procs]
                    raise KVFlowError(self._failure(workdir, codes, runs))
                if time.monotonic() > deadline:
                    phases = ", ".join(f"{self._who(workdir, g, runs)} at {_phase(workdir, g)}"
                                       for g, c in enumerate(codes) if c is None)
                    raise KVFlowError(f"pipeline did not finish within {self.timeout_s:g} s; still running: {phases}")
                time.sleep(POLL_S)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()

    def _failure(self, workdir: Path, codes: list[int | None], runs: list[PipelineRun]) -> str:
        """One line: the stage that failed first in cause (a signal, then its own error, then a peer's loss)."""
        failed = [(g, c) for g, c in enumerate(codes) if c not in (None, 0)]
        errors = {g: _error(workdir, g) for g, _ in failed}
        ranked = sorted(failed, key=lambda gc: (gc[1] >= 0, errors[gc[0]].get("peer", True), gc[0]))
        g, code = ranked[0]
        who, where = self._who(workdir, g, runs), _phase(workdir, g)
        if code < 0:
            name = signal.Signals(-code).name
            return f"pipeline {who} died with signal {-code} ({name}) at {where}; the other stages were stopped"
        err = errors[g]
        if err:
            return f"pipeline {who} failed at {where}: {err['type']}: {err['message']}"
        last = _last_line(workdir / f"stage{g}.log")
        return f"pipeline {who} exited with code {code} at {where}" + (f": {last}" if last else "")

    @staticmethod
    def _who(workdir: Path, g: int, runs: list[PipelineRun]) -> str:
        phase = _phase(workdir, g)
        if phase.startswith("run "):
            r = int(phase.split()[1])
            if g < len(runs[r].stages):
                a, b = runs[r].stages[g]
                return f"stage {g} (layers {a}-{b - 1})"
        return f"stage {g}"

    def _collect(self, workdir: Path, r: int, run: PipelineRun) -> PipelineResult:
        parts = [torch.load(workdir / f"run{r}-stage{g}.pt", weights_only=False) for g in range(len(run.stages))]
        reports = [StageReport(**{**p["report"], "layers": tuple(p["report"]["layers"])}) for p in parts]
        kv = [layer for p in parts for layer in p["kv"]] if run.return_kv else None
        head = reports[0].pipeline
        return PipelineResult(run.label, run.mode, reports, reports[-1].ttft_s, parts[-1]["logits"], kv,
                              head["lower_bound_s"], head["predicted_ttft_s"], head["describe"], head["balance"])


def _ids(tokens) -> list[int]:
    return [int(t) for t in torch.as_tensor(tokens, dtype=torch.long).view(-1).tolist()]


def _pool_dict(cfg) -> dict:
    return asdict(cfg)


def _phase(workdir: Path, g: int) -> str:
    try:
        return (workdir / f"stage{g}.phase").read_text() or "start"
    except FileNotFoundError:
        return "start-up"


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except FileNotFoundError:
        return ""
    return lines[-1][:300] if lines else ""


def _error(workdir: Path, g: int) -> dict:
    try:
        return json.loads((workdir / f"stage{g}.error").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
