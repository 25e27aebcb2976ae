"""`kvflow serve`: the OpenAI-compatible server over the kvflow engine."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Optional

import typer

from kvflow.cli.limits import MAX_RHO, seed_option
from kvflow.cli.main import app, bench_app
from kvflow.errors import KVFlowError


def _check_listen(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise KVFlowError(f"--port must be in 1..65535, got {port}")
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as err:
        raise KVFlowError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


@app.command()
def serve(model: str = typer.Option("tiny", "--model", help="preset name or local transformers checkpoint directory"),
          config: Optional[Path] = typer.Option(None, "--config", help="YAML/TOML with engine: and pool: sections"),
          host: str = typer.Option("127.0.0.1", "--host"),
          port: int = typer.Option(8000, "--port"),
          api_key: Optional[str] = typer.Option(None, "--api-key", envvar="KVFLOW_API_KEY",
                                                help="require 'Authorization: Bearer KEY' on every route but /health"),
          seed: int = seed_option("weights seed of a random-weight preset"),
          elastic_reserve: bool = typer.Option(False, "--elastic-reserve",
                                               help="lend the prefill activation reserve as KV blocks while only "
                                                    "decodes run (engine.elastic_reserve)"),
          log_level: str = typer.Option("info", "--log-level")) -> None:
    """Serve MODEL with /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics."""
    import logging

    from kvflow.server import serve as run

    if config is not None and not config.is_file():
        raise KVFlowError(f"config file {config} not found")
    _check_listen(host, port)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(model, str(config) if config else None, host=host, port=port, api_key=api_key, seed=seed,
        log_level=log_level, elastic_reserve=elastic_reserve)


@bench_app.command("decode")
def bench_decode(model: str = typer.Option("tiny", help="preset or checkpoint directory"),
                 sequences: int = typer.Option(8, help="sequences decoded together"),
                 prompt_len: int = typer.Option(32), max_tokens: int = typer.Option(64),
                 repeats: int = typer.Option(3, help="interleaved rounds (the median is reported)"),
                 out: Optional[Path] = typer.Option(None, help="output folder (default runs/decode-TIME)"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """Batched decode: N sequences in one engine vs the same N one at a time (tokens/s ratio)."""
    from kvflow import load_model
    from kvflow.report import out_dir, report
    from kvflow.bench.serve_bench import batched_decode

    if min(sequences, prompt_len, max_tokens) < 2 or repeats < 1:
        raise KVFlowError("--sequences, --prompt-len and --max-tokens must be >= 2, --repeats >= 1")
    runner = load_model(model)
    runner.check_context_len(prompt_len + max_tokens, copies=2 * sequences)    # one cache each, twice (together, alone)
    folder = out_dir("decode", out)
    res = batched_decode(runner, sequences, prompt_len, max_tokens, repeats=repeats)
    row = {k: res[k] for k in ("model", "sequences", "together_decode_tok_s", "one_at_a_time_decode_tok_s",
                               "decode_speedup", "end_to_end_speedup", "step_speedup", "same_tokens")}
    report(res, folder, [("batched decode", [row])], as_json, f"results in {folder}")


@bench_app.command("serve")
def bench_serve(url: Optional[str] = typer.Option(None, help="an OpenAI-compatible server (…/v1); default: "
                                                  "start a local kvflow server (a process of its own) for each "
                                                  "--configs entry"),
                served_model: Optional[str] = typer.Option(None, help="model name at --url"),
                model: str = typer.Option("tiny", help="local server: preset or checkpoint directory"),
                workload: str = typer.Option("chat", help="chat | docqa | agent (docs: kvflow/bench/serve_bench.py)"),
                configs: str = typer.Option("resident,recompute,cacheflow",
                                            help="local kvflow configurations: resident (no pool) or a strategy "
                                                 "restoring pool hits; +fcfs or +first-token (the default) picks "
                                                 "the scheduling policy, e.g. cacheflow+fcfs"),
                kv_share: float = typer.Option(0.25, help="resident KV budget as a share of the working set"),
                users: int = typer.Option(8), rounds: Optional[int] = typer.Option(None, help="chat: 12, else 4"),
                rate: float = typer.Option(2.0),
                system_tokens: Optional[int] = typer.Option(None, help="chat: 1024, else 256"),
                user_tokens: Optional[int] = typer.Option(None, help="chat: 128, else 64"),
                answer_tokens: Optional[int] = typer.Option(None, help="chat: 96, else 16"),
                think: Optional[float] = typer.Option(None, help="mean think time s (chat: 2, else 0.5)"),
                docs: int = typer.Option(4, help="docqa: documents"),
                doc_min: int = typer.Option(1024, help="docqa: shortest document (tokens)"),
                doc_max: int = typer.Option(4096, help="docqa: longest document (tokens)"),
                tool_tokens: int = typer.Option(128, help="agent: mean tool output (tokens)"),
                block_size: int = typer.Option(16, min=1), chunk_tokens: int = typer.Option(64, min=1),
                max_batched: int = typer.Option(512, min=1, help="max_num_batched_tokens"),
                pool_dir: Optional[Path] = typer.Option(None, help="pool on disk: a fresh extent file per "
                                                        "configuration under this folder (default: in memory)"),
                rho: Optional[float] = typer.Option(None, help="throttle the pool to rho x the recompute rate"),
                seed: int = seed_option(),
                repeats: int = typer.Option(1, help="local server: rounds over all configurations, alternated "
                                            "(medians reported)"),
                peer: Optional[str] = typer.Option(None, help="vllm: also serve the same model with vLLM-cpu (built "
                                                   "by `make vllm`), same KV budget, workload and seed, a round "
                                                   "after each round of the kvflow configurations"),
                peer_venv: Optional[Path] = typer.Option(None, help="the peer's venv (default: .venv-vllm, or "
                                                         "$KVFLOW_VLLM_VENV)"),
                peer_timeout: float = typer.Option(600.0, help="seconds the peer may take to become healthy"),
                token_ids: bool = typer.Option(False, "--token-ids", help="send prompts as token ids to "
                                               "/v1/completions (always on with --peer)"),
                out: Optional[Path] = typer.Option(None, help="output folder (default runs/serve-TIME)"),
                as_json: bool = typer.Option(False, "--json")) -> None:
    """Chat / document-QA / agent load (Poisson arrivals, seeded): TTFT P50/P90/P99, ITL, throughput, hit split."""
    import asyncio
    import contextlib
    from functools import partial

    from kvflow.report import out_dir, report, save_figure
    from kvflow.demo.chat import (ChatWorkload, draw_cdf, prompts_digest, records_json, longest_history_tokens,
                                  median_summary, result_row, run_chat, summarize, working_set_tokens)
    from kvflow.server.process import ServerProcess, engine_for

    w = ChatWorkload.of(workload, users=users, rounds=rounds, rate=rate, system_tokens=system_tokens,
                        user_tokens=user_tokens, answer_tokens=answer_tokens, think_s=think, docs=docs,
                        doc_tokens_min=doc_min, doc_tokens_max=doc_max, tool_tokens=tool_tokens, seed=seed)
    if peer is not None:
        from kvflow.bench.peer import PEERS
        if peer not in PEERS:
            raise KVFlowError(f"unknown --peer {peer!r}: use {', '.join(PEERS)}")
        if url is not None:
            raise KVFlowError("--peer runs beside the local kvflow configurations, not with --url")
        if not 0 < peer_timeout <= 86400:
            raise KVFlowError(f"--peer-timeout must be in (0, 86400] seconds, got {peer_timeout:g}")
        token_ids = True
    if url is not None and token_ids:
        raise KVFlowError("--token-ids needs the local model's tokenizer, not --url")
    folder = out_dir("serve", out)
    runs, rows, results = {}, [], {"workload": {**{k: getattr(w, k) for k in w.__slots__}}, "runs": {}}
    if url is not None:
        if not served_model:
            raise KVFlowError("--url needs --served-model (the model name that server serves)")
        records, wall = asyncio.run(run_chat(url, served_model, w))
        summary = summarize(records, wall)
        runs[url] = records
        rows.append(result_row(url, summary, None))
        results["runs"][url] = {"summary": summary, "turns": records_json(records)}
    else:
        from kvflow import load_model
        from kvflow.cli.restore_cmds import ensure_cost
        from kvflow.engine.config import SCHEDULING_POLICIES
        from kvflow.planner import STRATEGIES

        names = [c.strip() for c in configs.split(",") if c.strip()]

        def parts(name: str) -> tuple[str, str | None]:
            """(strategy, scheduling policy; None: the engine's default)"""
            strategy, plus, policy = name.partition("+")
            return strategy, policy if plus else None
        bad = [c for c in names if parts(c)[0] not in ("resident", *STRATEGIES)
               or parts(c)[1] not in (None, *SCHEDULING_POLICIES)]
        if not names or bad:
            raise KVFlowError(f"bad --configs entry {bad[0] if bad else configs!r}: resident or a strategy "
                              f"({', '.join(STRATEGIES)}), optionally +POLICY ({', '.join(SCHEDULING_POLICIES)})")
        if not 0 < kv_share <= 4:
            raise KVFlowError("--kv-share must be in (0, 4]")
        if repeats < 1:
            raise KVFlowError("--repeats must be >= 1")
        if rho is not None and not 0 < rho <= MAX_RHO:
            raise KVFlowError(f"--rho must be in (0, {MAX_RHO:g}]")
        venv = None
        if peer is not None:
            from kvflow.bench.peer import NOT_INSTALLED
            from kvflow.integrations.vllm_server import vllm_venv
            venv = vllm_venv(peer_venv)
            if venv is None:
                typer.echo(f"note: {NOT_INSTALLED}" + (f" (no vLLM in {peer_venv})" if peer_venv else ""),
                           err=True)
                results["peer"] = {"name": peer, "skipped": NOT_INSTALLED}
        from kvflow.threads import in_fresh_thread

        # every set-up step that computes runs on a thread of its own, so that this (the client's) thread keeps no
        # OpenMP team beside the engine thread's: kvflow/threads.py
        runner = in_fresh_thread(load_model, model)
        cost = in_fresh_thread(ensure_cost, runner, 8192) if any(parts(c)[0] != "resident" for c in names) else None
        ws = working_set_tokens(w)
        kv_tokens = max(int(ws * kv_share), longest_history_tokens(w) + w.answer_tokens + block_size)
        kv_budget = kv_tokens * runner.kv_bytes_per_token()
        rate = None
        if rho is not None:
            from kvflow.bench.bound import recompute_rate
            rate = in_fresh_thread(recompute_rate, runner, chunk_tokens)
        results.update(model=model, working_set_tokens=ws, kv_budget_tokens=kv_tokens, rho=rho,
                       recompute_rate_bytes_per_s=rate,
                       pool="memory" if pool_dir is None else f"extent file under {pool_dir}")
        tokenizer = None
        if token_ids:
            from kvflow.engine.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(model, runner.config.vocab_size)
        rounds_of = {name: [] for name in names}
        with contextlib.ExitStack() as stack:         # the peer, if any, is stopped whatever happens
            vllm = None
            if venv is not None:
                from kvflow.bench.peer import running_peer
                typer.echo(f"starting the {peer} peer from {venv} (log: {folder / 'vllm.log'}) ...", err=True)
                vllm = in_fresh_thread(stack.enter_context,        # saving the checkpoint computes
                                       running_peer(peer, runner, model, kv_tokens, block_size, max_batched, folder,
                                                    venv, seed=seed, timeout_s=peer_timeout))
                rounds_of[peer] = []
                results["peer"] = {"name": peer, "venv": str(venv), "command": vllm.command(),
                                   "env": {k: v for k, v in vllm.env().items() if k.startswith("VLLM_")},
                                   "block_size": vllm.profile.peer_block_size,
                                   "num_blocks": vllm.profile.num_blocks,
                                   "kv_budget_tokens": vllm.profile.max_model_len}
            for _ in range(repeats):                  # configurations alternate: a shared machine drifts
                for name in names:
                    strategy, policy = parts(name)
                    build = partial(engine_for, model, 0, strategy=None if strategy == "resident" else strategy,
                                    scheduling_policy=policy,
                                    kv_budget=kv_budget, block_size=block_size,
                                    pool_bytes=4 * ws * runner.kv_bytes_per_token() + (64 << 20),
                                    chunk_tokens=chunk_tokens, max_num_batched_tokens=max_batched, cost=cost,
                                    pool_dir=None if pool_dir is None else str(pool_dir), rho=rho,
                                    recompute_rate=rate)
                    with ServerProcess(build, model) as server:       # its own process: no GIL with this client
                        records, wall = asyncio.run(run_chat(server.url, model, w, tokenizer=tokenizer))
                    rounds_of[name].append((records, summarize(records, wall), server.hit_split()))
                if vllm is not None:                  # right after, same workload and seed, its cache emptied
                    if not vllm.reset_prefix_cache():
                        raise KVFlowError("the vLLM peer did not empty its prefix cache before a round")
                    records, wall = asyncio.run(run_chat(vllm.url, model, w, tokenizer=tokenizer))
                    rounds_of[peer].append((records, summarize(records, wall), None))
        for name, rounds_ in rounds_of.items():
            summary = median_summary([r[1] for r in rounds_])
            split = rounds_[-1][2]
            runs[name] = [rec for r in rounds_ for rec in r[0]]
            rows.append(result_row(name, summary, split))
            results["runs"][name] = {"summary": summary, "hit_split": split,
                                     "rounds": [{"summary": r[1], "hit_split": r[2]} for r in rounds_],
                                     "turns": records_json(rounds_[-1][0])}
            if tokenizer is not None:
                results["runs"][name]["prompts_digest"] = [prompts_digest(r[0]) for r in rounds_]
        if peer in rounds_of:
            ref = results["runs"][peer]["summary"]

            def paired(name: str, k: str) -> list[float]:           # round i against the peer's round i
                return [a[1][k] / b[1][k] for a, b in zip(rounds_of[name], rounds_of[peer])]
            results["vs_peer"] = {name: {**{f"{k}_ratio": results["runs"][name]["summary"][k] / ref[k]
                                            for k in ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "later_ttft_p99_s",
                                                      "later_ttft_mean_s")},
                                         "rounds_ttft_p99_ratio": paired(name, "ttft_p99_s"),
                                         "rounds_ttft_mean_ratio": paired(name, "ttft_mean_s")}
                                  for name in names}
            digests = {d for name in rounds_of for d in results["runs"][name]["prompts_digest"]}
            results["same_prompts"] = len(digests) == 1
    title = {"chat": "multi-round chat", "docqa": "long-document QA", "agent": "agent pipeline"}[workload]
    save_figure(folder / "ttft_cdf.png", draw_cdf(runs, title))
    footer = f"results in {folder} (results.json, ttft_cdf.png)"
    if "vs_peer" in results:
        ratios = ", ".join(f"{n} P99 {v['ttft_p99_s_ratio']:.2f}x mean {v['ttft_mean_s_ratio']:.2f}x "
                           f"(later turns P99 {v['later_ttft_p99_s_ratio']:.2f}x)"
                           for n, v in results["vs_peer"].items())
        footer = (f"TTFT vs {peer}: {ratios}; same prompt ids on both: {results['same_prompts']}\n" + footer)
    report(results, folder, [(title, rows)], as_json, footer)


@bench_app.command("soak")
def bench_soak(url: Optional[str] = typer.Option(None, help="an OpenAI-compatible server (…/v1); default: "
                                                 "a local kvflow server"),
               served_model: Optional[str] = typer.Option(None, help="model name at --url"),
               pid: Optional[int] = typer.Option(None, min=1, help="with --url: the server's pid, to sample its RSS"),
               model: str = typer.Option("tiny", help="local server: preset or checkpoint directory"),
               config: Optional[Path] = typer.Option(None, help="local server: engine:/pool: config file"),
               clients: int = typer.Option(8), duration: float = typer.Option(300.0, help="seconds"),
               seed: int = seed_option(),
               out: Optional[Path] = typer.Option(None, help="output folder (default runs/soak-TIME)"),
               as_json: bool = typer.Option(False, "--json")) -> None:
    """Valid clients + a bad-input barrage for DURATION: errors on valid requests, 4xx on bad ones, RSS growth."""
    import asyncio

    from kvflow.report import out_dir, report
    from kvflow.bench.serve_bench import run_soak
    from kvflow.server.process import ServerProcess
    from kvflow.stats import rss_bytes

    if not 1 <= clients <= 10_000 or not 0 < duration <= 7 * 86400:
        raise KVFlowError(f"--clients must be 1..10000 and --duration in (0, 604800] seconds, got {clients} and "
                          f"{duration:g}")
    folder = out_dir("soak", out)
    if url is not None:
        if not served_model:
            raise KVFlowError("--url needs --served-model (the model name that server serves)")
        res = asyncio.run(run_soak(url, served_model, clients, duration, seed,
                                   (lambda: rss_bytes(pid)) if pid else None))
    else:
        from functools import partial

        from kvflow.server import build_engine
        with ServerProcess(partial(build_engine, model, str(config) if config else None), model) as server:
            res = asyncio.run(run_soak(server.url, model, clients, duration, seed,
                                       lambda: rss_bytes(server.pid)))
    row = {k: res.get(k) for k in ("clients", "duration_s", "valid", "valid_errors", "bad", "bad_4xx", "bad_other",
                                   "hangups", "rss_growth")}
    report(res, folder, [("soak", [row])], as_json, f"results in {folder}")
    if res["valid_errors"] or res["bad_other"]:
        raise typer.Exit(1)
