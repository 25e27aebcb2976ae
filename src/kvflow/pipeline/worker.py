"""One pipeline stage as a process: ``python -m kvflow.pipeline.worker SPEC RANK`` (the launcher starts these).

    set up   build the model (same name + seed -> same weights; fingerprint checked against the parent's), open the
             pool read-only, join the process group (gloo, 127.0.0.1)
    per run  barrier + one clock for all stages
             look up + plan every stage (same index, same numbers -> every stage derives the same plans)
             restore this stage's grid: executor on the stage's own layers, own link (throttle), own inputs
             tail + query pass: hidden states from stage g-1, this stage's layers, on to stage g+1 (last: logits)
             serve repairs until the next stage says DONE: a chunk a stage could not fill (KV and activation both
             unreadable) is recomputed from the previous stage's hidden states — "waiting for the previous stage"

Progress goes to ``DIR/stage<g>.phase`` and a failure to ``DIR/stage<g>.error`` (one line), so the launcher can
say which stage failed where. Results: ``DIR/run<r>-stage<g>.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this stage when the launcher goes away, so no stage outlives its run."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def _pieces(a: int, b: int, step: int) -> list[tuple[int, int]]:
    return [(x, min(x + step, b)) for x in range(a, b, step)]


def _prefix(flags: list[bool]) -> int:
    return next((i for i, ok in enumerate(flags) if not ok), len(flags))


PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed")


class Stage:
    def __init__(self, spec: dict, rank: int):
        self.spec, self.rank = spec, rank
        self.dir = Path(spec["dir"])
        self.faults = spec.get("faults") or {}
        self.executor = None                            # made at the first run, kept for every other

    # ------------------------------------------------------------------------------------------ set up
    def phase(self, name: str) -> None:
        tmp = self.dir / f"stage{self.rank}.phase.tmp"
        tmp.write_text(name)
        os.replace(tmp, self.dir / f"stage{self.rank}.phase")
        if self.faults.get("stage") == self.rank and self.faults.get("at") == name:   # tests: a stage that dies
            action = self.faults.get("action", "kill")
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if action == "hang":
                time.sleep(1e6)
            raise RuntimeError(f"injected fault at {name}")

    def setup(self) -> None:
        import torch.distributed as dist

        from kvflow.cost.model import CostModel
        from kvflow.errors import KVFlowError
        from kvflow.model import load_model
        from kvflow.pool import KVPool

        spec = self.spec
        torch.set_num_threads(spec["threads"])
        self.phase("model")
        from kvflow.pipeline.comm import backend, stage_device, wire_device
        device = stage_device(spec.get("device", "cpu"), self.rank, spec["world_size"])
        if device.type == "cuda":
            torch.cuda.set_device(device)         # NCCL's and the caching allocator's device for this process
        self.runner = load_model(spec["model"], seed=spec["seed"], dtype=spec["dtype"], device=device)
        if self.runner.fingerprint != spec["fingerprint"]:
            raise KVFlowError(f"model {spec['model']} built in this stage differs from the parent's (fingerprint "
                              f"{self.runner.fingerprint[:12]} vs {spec['fingerprint'][:12]})")
        self.phase("pool")
        self.pool = KVPool.open(spec["pool"], readonly=True)
        self.cost = CostModel(**spec["cost"])
        self.phase("connect")
        self.backend = backend(spec.get("device", "cpu"), spec["world_size"])
        self.wire = wire_device(self.backend, device)
        dist.init_process_group(self.backend, init_method=spec["init_method"], rank=self.rank,
                                world_size=spec["world_size"], timeout=timedelta(seconds=spec["timeout_s"]))

    # ------------------------------------------------------------------------------------------ one run
    def run(self, r: int, run: dict) -> None:
        import torch.distributed as dist

        from kvflow.chunks.keys import chunk_keys, layer_groups
        from kvflow.chunks.record import HEADER_SIZE, kv_record_dtype
        from kvflow.executor import Executor
        from kvflow.pipeline.channel import CONTROL, DATA, DONE, END, REPAIR, Channel
        from kvflow.pipeline.links import ActivationInputs, EmbedInputs, Handoff, HandoffInputs
        from kvflow.planner import PlannerConfig, Request
        from kvflow.planner.pipeline import PipelinePlanner, stage_rate

        runner, pool, rank = self.runner, self.pool, self.rank
        stages = [tuple(s) for s in run["stages"]]
        S, last = len(stages), self.rank == len(stages) - 1
        self.phase(f"run {r} start")
        bandwidths = run["bandwidths"]
        pool.set_throttle(bandwidths[rank] if bandwidths and rank < S else None)
        dist.barrier()
        origin = torch.tensor([time.perf_counter()], dtype=torch.float64, device=self.wire)
        dist.broadcast(origin, 0)                 # CLOCK_MONOTONIC is machine-wide: one time axis for all stages
        t0 = float(origin.cpu())
        if rank >= S:
            return                                # this run uses fewer stages
        clock = lambda: time.perf_counter() - t0  # noqa: E731

        # -- look up + plan (every stage plans the whole pipeline; only its own part is used) ------------------
        self.phase(f"run {r} plan")
        ctx = torch.tensor(self.spec["contexts"][run["context"]], dtype=torch.long)
        query = torch.tensor(run["query"], dtype=torch.long)
        ids = torch.cat([ctx, query])
        C, L, fp = pool.chunk_tokens, runner.num_layers, runner.fingerprint
        groups = layer_groups(L, 1)
        n = pool.longest_prefix(ctx, fp, groups) // C
        keys = chunk_keys(ctx, fp, C, groups)[:n]
        act_keys = {b: [row[0] for row in chunk_keys(ctx, fp, C, [(b, b)], kind="act")[:n]] for b, _ in stages[1:]}
        act_chunks = [n] + [_prefix(pool.contains(act_keys[b])) for b, _ in stages[1:]]
        links = bandwidths or [pool.read_bandwidth] * S
        cell = C * runner.shape.kv_bytes_per_token_layer(kv_record_dtype(pool.dtype, runner.dtype)) + HEADER_SIZE
        act = C * runner.hidden_size * 4 + HEADER_SIZE
        planner = PipelinePlanner(self.cost, C, cell, act, PlannerConfig(**self.spec["planner"]))
        req = Request(ctx.numel(), query.numel(), n)
        pplan = planner.plan(req, stages, links, run["mode"], act_chunks, run["strategy"], suggest=False)
        sp = pplan.stages[rank]
        (l0, l1), plan = sp.layers, sp.plan
        plan_end = clock()

        # -- restore this stage's grid ----------------------------------------------------------------------
        self.phase(f"run {r} restore")
        where = {"wire": self.wire, "compute": runner.device}
        data_in = Channel(rank - 1, DATA, runner.hidden_size, runner.dtype, **where) if rank > 0 else None
        data_out = Channel(rank + 1, DATA, runner.hidden_size, runner.dtype, **where) if not last else None
        control_in = Channel(rank + 1, CONTROL, runner.hidden_size, runner.dtype, **where) if not last else None
        control_out = Channel(rank - 1, CONTROL, runner.hidden_size, runner.dtype, **where) if rank > 0 else None
        if sp.inputs == "embed":
            source = EmbedInputs(runner, ids)
        elif sp.inputs == "act":
            source = ActivationInputs(pool, act_keys[l0][:sp.act_chunks], C, [s.tokens for s in plan.compute], clock)
        else:
            source = HandoffInputs(data_in)
        link = Handoff(source, data_out, per_step=run["handoff"] == "step") if sp.handoff else source
        stage_keys = [[row[layer] for layer in range(l0, l1)] for row in keys]
        if self.executor is None:
            self.executor = Executor(runner, pool)      # one per stage: its staging buffers serve every run
        execution = self.executor.run(plan, stage_keys, ids, link=link, origin=t0)
        if isinstance(source, HandoffInputs):
            source.drain()
        cache, events = execution.cache, list(execution.timeline)
        restore_end = execution.timings.restore_s

        # -- tail + query through the pipeline ---------------------------------------------------------------
        self.phase(f"run {r} query")
        step, end = plan.step_tokens, ids.numel()
        own = execution.complete_chunks * C          # this stage holds [0, own) of the context
        repaired: list[list[int]] = []

        def ask_previous(a: int, b: int) -> list[tuple[int, torch.Tensor]]:
            """Hidden states entering this stage for [a, b), recomputed by the previous stage."""
            repaired.append([a, b])
            control_out.send(REPAIR, a, b)
            return receive()

        def receive() -> list[tuple[int, torch.Tensor]]:
            got = []
            while (msg := data_in.recv()).kind != END:
                got.append((msg.a, msg.hidden))
            return got

        def inputs_for(a: int, b: int) -> list[tuple[int, torch.Tensor]]:
            if rank == 0:
                return [(x, runner.embed(ids[x:y])) for x, y in _pieces(a, b, step)]
            if isinstance(source, ActivationInputs) and (hidden := source.load(a, b)) is not None:
                return [(a, hidden)]
            return ask_previous(a, b)

        w0 = clock()
        if rank == 0:
            incoming = inputs_for(own, end)
        else:
            incoming = receive()
            first = incoming[0][0] if incoming else end
            if own < first:
                incoming = ask_previous(own, first) + incoming
        query_start = clock()
        if query_start - w0 > 1e-3:
            events.append(_event("wait", (own, end), (l0, l1), w0, query_start))
        out = None
        for a, hidden in incoming:
            out = runner.run_layers(cache, hidden, a, (l0, l1))
            if not last:
                data_out.piece(a, out)
        if not last:
            data_out.send(END)
        query_end = clock()
        events.append(_event("query", (incoming[0][0], end), (l0, l1), query_start, query_end))
        logits, ttft = None, None
        if last:
            logits = runner.logits(out)
            ttft = clock()
            events.append(_event("head", (end - 1, end), (L, L), query_end, ttft))

        # -- serve repairs for the next stage, then tell the previous one we are done ------------------------
        self.phase(f"run {r} serve")
        if not last:
            while (msg := control_in.recv()).kind != DONE:
                for a, hidden in inputs_for(msg.a, msg.b):
                    data_out.piece(a, runner.run_layers(cache, hidden, a, (l0, l1)))
                data_out.send(END)
        if rank > 0:
            control_out.send(DONE)
        for ch in (data_in, data_out, control_in, control_out):
            if ch is not None:
                ch.flush()
        act_events = list(getattr(source, "events", []))
        if isinstance(source, ActivationInputs):
            source.close()

        computed = sum((e.tokens[1] - e.tokens[0]) // C for e in events if e.kind == "compute")
        loaded = sum((e.tokens[1] - e.tokens[0]) // C for e in events if e.kind == "load")
        report = {
            "stage": rank, "layers": [l0, l1], "inputs": sp.inputs, "mode": run["mode"], "label": run["label"],
            "plan": sp.plan.describe(), "split": list(sp.plan.split), "bandwidth": sp.bandwidth,
            "act_chunks": sp.act_chunks, "bound_s": sp.bound_s, "predicted_restore_s": sp.predicted_restore_s,
            "plan_s": plan_end, "restore_s": restore_end, "grid_compute_end_s": execution.timings.grid_compute_end_s,
            "compute_busy_s": execution.timings.compute_busy_s, "io_busy_s": execution.timings.io_busy_s,
            "act_io_busy_s": getattr(source, "io_busy", 0.0), "blocked_s": execution.timings.blocked_io_s,
            "recomputed_chunks": computed, "loaded_chunks": loaded,
            "act_failed": sorted(getattr(source, "failed", [])), "fallback_chunks": execution.fallback_chunks,
            "complete_chunks": execution.complete_chunks, "num_chunks": n, "repaired": repaired,
            "query_start_s": query_start, "query_end_s": query_end, "ttft_s": ttft,
            "events": [[e.kind, *e.tokens, *e.layers, e.start, e.end] for e in sorted(events + act_events,
                                                                                     key=lambda e: e.start)],
        }
        if rank == 0:                             # the split search is off the restoration's critical path
            rate = (lambda k: bandwidths[0] * stage_rate(self.cost, k, C) / stage_rate(self.cost, l1 - l0, C)) \
                if bandwidths else None
            balance = planner.balance(req, stages, links, rate)
            pplan = replace(pplan, balance=balance)
            report["pipeline"] = {"describe": pplan.describe(), "lower_bound_s": pplan.lower_bound_s,
                                  "predicted_ttft_s": pplan.predicted_ttft_s, "num_chunks": n,
                                  "balance": {"stage_bounds": list(balance.stage_bounds),
                                              "imbalance": balance.imbalance, "unbalanced": balance.unbalanced,
                                              "suggested": balance.suggested, "gain": balance.gain,
                                              "suggested_bound_s": balance.suggested_bound_s,
                                              "describe": balance.describe()}}
        kv = None
        if run["return_kv"]:
            kv = [(cache.keys[layer][:, :, :end].cpu().clone(), cache.values[layer][:, :, :end].cpu().clone())
                  for layer in range(l0, l1)]
        path = self.dir / f"run{r}-stage{rank}.pt"
        torch.save({"report": report, "kv": kv, "logits": logits}, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)

    def finish(self) -> None:
        import torch.distributed as dist
        self.phase("finish")
        dist.barrier()
        dist.destroy_process_group()
        self.phase("done")


def _event(kind, tokens, layers, start, end):
    from kvflow.executor import Event
    return Event(kind, tuple(tokens), tuple(layers), start, end)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    rank = int(argv[1])
    _die_with_parent(int(spec["parent"]))
    stage = Stage(spec, rank)
    try:
        stage.setup()
        for r, run in enumerate(spec["runs"]):
            stage.run(r, run)
        stage.finish()
        return 0
    except BaseException as err:   # noqa: BLE001 — every failure becomes one line for the launcher
        from kvflow.errors import KVFlowError
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        info = {"type": type(err).__name__, "message": text, "peer": any(p in str(err) for p in PEER_ERRORS),
                "user": isinstance(err, KVFlowError)}
        (stage.dir / f"stage{rank}.error").write_text(json.dumps(info))
        traceback.print_exc()
        return 2 if isinstance(err, KVFlowError) else 1


if __name__ == "__main__":
    sys.exit(main())
