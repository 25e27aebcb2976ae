"""The main job (``make demo`` = ``kvflow demo``): the serving engine on a real model, under memory pressure.

    model     smollm2-135m (model/catalog.py: SmolLM2-135M-Instruct, converted once; its tokenizer and chat
              template), EngineConfig's defaults (blocks of 16 tokens, 512 tokens a step, chunked prefill, prefix
              caching); the activation reserve is the model shape's formula (nothing here judges memory, and a
              probe per server would cost more than the chat); ``--model tiny`` runs the same on random weights
    pool      on this machine's disk under ./.kvflow/demo/ (a fresh extent file per configuration, chunks of 64
              tokens — the serve default), unthrottled; removed after each configuration's run
    budget    resident KV for a quarter of the working set (at least the longest conversation), so most users'
              histories are evicted before their next turn and come back from the pool
    workload  the multi-round chat of demo/chat.py with the written conversations of demo/texts.py (each user asks
              about a reference document; Poisson arrivals, think time, the whole history resent every turn, the
              model's own greedy answers in it), as chat messages through the official ``openai`` client to the
              server, which renders them with the model's chat template
    configs   ``recompute`` and ``cacheflow``: the strategy that restores pool hits; alternated over ``repeats``
    check     after the last cacheflow run, user 0's conversation is replayed through that server (its prefixes are
              resident or in the pool by then); every answer's tokens are compared with transformers' greedy
              ``generate`` on the prompt ids the server rendered (the same chat template, the same count), and with
              the answers user 0 was served during the run
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from functools import partial

from kvflow.demo.chat import (ChatWorkload, longest_history_tokens, median_summary, records_json, result_row,
                              run_chat, sessions, summarize, working_set_tokens)
from kvflow.demo.texts import user_name
from kvflow.engine import EngineConfig
from kvflow.server.process import ServerProcess, engine_for

STRATEGIES = ("recompute", "cacheflow")
Tick = Callable[[int, int], None]          # (finished requests, total requests)
Say = Callable[[str], None]                # what the demo is doing now (the progress bar's description)


def budget_tokens(w: ChatWorkload, kv_share: float, block_size: int, tokenizer=None) -> int:
    """Resident KV tokens: ``kv_share`` of the working set, but never less than the longest single request."""
    return max(int(working_set_tokens(w, tokenizer) * kv_share),
               longest_history_tokens(w, tokenizer) + w.answer_tokens + block_size)


def run_demo(runner, cost, w: ChatWorkload, *, home: str | Path, chunk_tokens: int, tokenizer,
             strategies=STRATEGIES, kv_share: float = 0.25, repeats: int = 2, check: bool = True,
             tick: Tick = lambda done, total: None, say: Say = lambda what: None,
             model: str | None = None, seed: int = 0) -> tuple[dict, dict]:
    """Run the chat workload once per strategy per repeat (alternated); returns (results for JSON, TTFT records per
    strategy for the CDF). Each configuration's server runs in a process of its own (server/process.py),
    built from ``model`` (default ``runner.name``) with weights ``seed``: the same weights as ``runner``, which the
    check compares against; ``tokenizer`` is the model's (engine/tokenizer.py), the one the servers use."""
    model = model or runner.name
    defaults = EngineConfig()
    block, step = defaults.block_size, defaults.max_num_batched_tokens
    ws = working_set_tokens(w, tokenizer)
    kv_tokens = budget_tokens(w, kv_share, block, tokenizer)
    reserve = runner.shape.activation_bytes(step, runner.dtype)
    kv = runner.kv_bytes_per_token()
    pool_bytes = ((4 * ws * kv) >> 20) + 64 << 20           # whole MiB: an extent file wants an aligned size
    pool_dir = Path(home) / "demo"
    total = repeats * len(strategies) * w.users * w.rounds + (w.rounds if check else 0)
    done = 0
    rounds = {s: [] for s in strategies}
    exact = None
    load_before = os.getloadavg()
    for rep in range(repeats):
        order = list(strategies) if rep % 2 == 0 else list(reversed(strategies))   # neither always runs first
        for name in order:
            build = partial(engine_for, model, seed, strategy=name, kv_budget=kv_tokens * kv, block_size=block,
                            pool_bytes=pool_bytes, chunk_tokens=chunk_tokens, max_num_batched_tokens=step, cost=cost,
                            pool_dir=str(pool_dir), activation_reserve=reserve)
            base = done
            run = f"{name} ({rep + 1}/{repeats})" if repeats > 1 else name
            try:
                say(f"{run}: starting its server")
                with ServerProcess(build, model) as server:      # closes its pool when it stops
                    say(f"{run}: {w.users} users chatting")
                    records, wall = asyncio.run(run_chat(server.url, server.model, w,
                                                         on_turn=lambda n, _: tick(base + n, total)))
                    done = base + w.users * w.rounds
                    if check and name == "cacheflow" and rep == repeats - 1:
                        say(f"check: {user_name(0)}'s turns again, against transformers' generate")
                        exact = check_conversation(server.url, runner, tokenizer, w, records,
                                                   lambda n: tick(done + n, total))
                        done += w.rounds
                rounds[name].append((records, summarize(records, wall), server.hit_split()))
            finally:
                shutil.rmtree(pool_dir / f"serve-{name}", ignore_errors=True)
            tick(done, total)
    results = {"model": runner.name, "workload": {k: getattr(w, k) for k in w.__slots__},
               "working_set_tokens": ws, "kv_budget_tokens": kv_tokens, "kv_share": kv_share,
               "block_size": block, "max_num_batched_tokens": step, "chunk_tokens": chunk_tokens,
               "pool": f"extent file under {pool_dir} (unthrottled, removed after each run)", "repeats": repeats,
               "activation_reserve_bytes": reserve, "tokenizer": tokenizer.kind,
               "load_average": {"start": load_before, "end": os.getloadavg()}, "runs": {}, "exact": exact,
               "exchange": exchange(w, rounds["cacheflow"][-1][0] if rounds.get("cacheflow") else [])}
    cdf = {}
    for name, got in rounds.items():
        summary = median_summary([r[1] for r in got])
        results["runs"][name] = {"summary": summary, "hit_split": got[-1][2], "row": result_row(name, summary,
                                                                                                 got[-1][2]),
                                 "rounds": [{"summary": r[1], "hit_split": r[2]} for r in got],
                                 "turns": records_json(got[-1][0])}
        cdf[name] = [rec for r in got for rec in r[0]]
    return results, cdf


def exchange(w: ChatWorkload, records: list) -> dict | None:
    """User 0's last turn of a run as a person reads it: the question, the answer the server gave, its timing."""
    mine = sorted((r for r in records if r.user == 0 and r.error is None), key=lambda r: r.round)
    if not mine:
        return None
    last, s = mine[-1], sessions(w)[0]
    return {"user": user_name(0) if w.text == "written" else "user 0", "round": last.round,
            "question": s.turns[last.round][1], "answer": last.answer, "prompt_tokens": last.prompt_tokens,
            "cached_tokens": last.cached_tokens, "output_tokens": last.output_tokens, "ttft_s": last.ttft_s}


def check_conversation(url: str, runner, tokenizer, w: ChatWorkload, served: list,
                       tick: Callable[[int], None]) -> dict:
    """User 0's turns through the server at ``url`` (non-streaming, greedy, as the workload sends them); each
    answer's token ids against ``generate`` on the prompt the server rendered (``tokenizer.chat`` of the same
    messages: the server's own tokenizer and template, its prompt length checked), and against the answer user 0
    was served in the run (``served``: that run's records)."""
    import torch
    from kvflow.extras import require
    OpenAI = require("client").OpenAI

    s = sessions(w)[0]
    in_run = {r.round: r.answer_ids for r in served if r.user == 0 and r.error is None}
    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    history = [{"role": "system", "content": s.system}] if s.system is not None else []
    until_eos = {} if w.ignore_eos else {"eos_token_id": runner.hf_model.generation_config.eos_token_id}
    turns = []
    for k, (role, content, _) in enumerate(s.turns):
        messages = history + [{"role": role, "content": content}]
        reply = client.chat.completions.create(model=runner.name, messages=messages, max_tokens=w.answer_tokens,
                                               temperature=0, extra_body={"ignore_eos": w.ignore_eos})
        choice = reply.choices[0]
        got = list((choice.model_extra or {}).get("token_ids") or [])
        prompt = tokenizer.chat(messages)
        with torch.inference_mode():
            out = runner.hf_model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=w.answer_tokens, pad_token_id=0,
                **({"min_new_tokens": w.answer_tokens, "eos_token_id": None} if w.ignore_eos else until_eos))
        want = out[0, len(prompt):].tolist()
        details = reply.usage.prompt_tokens_details
        same_prompt = len(prompt) == reply.usage.prompt_tokens
        turns.append({"round": k, "prompt_tokens": reply.usage.prompt_tokens, "same_prompt": same_prompt,
                      "cached_tokens": (details.cached_tokens or 0) if details else 0,
                      "equal": same_prompt and got == want, "served_in_run_equal": in_run.get(k) == want,
                      "tokens": got, "generate": want, "answer": choice.message.content or ""})
        history = messages + [{"role": "assistant", "content": choice.message.content or ""}]
        tick(k + 1)
    client.close()
    return {"user": 0, "turns": turns, "all_equal": all(t["equal"] and t["served_in_run_equal"] for t in turns),
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
            "cached_tokens": sum(t["cached_tokens"] for t in turns)}


def elapsed(t0: float) -> str:
    s = time.perf_counter() - t0
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"
