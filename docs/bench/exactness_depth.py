"""How far kvflow's paths land from one full prefill on the real 30-layer model at long contexts, and how far that
full prefill itself is from other ways of computing it — the room the exactness bound (KV max |diff| <= 1e-4) leaves
at depth and length (docs/DESIGN.md, "Exactness").

    .venv/bin/python docs/bench/exactness_depth.py [--lengths 2048,8192] [--texts 0,1,human] [--out exactness_depth.json]

Per length and text, cut to the length in smollm2's own tokens: a number is a seed of random words (the matrix's
workload text, kvflow/demo/chat.py's ``_text``); ``human`` the demo's written reference documents, repeated
(kvflow/demo/texts.py's ``long_document``):

    engine     the engine's steps (BatchRunner, chunks of --step tokens) against kvflow's full prefill
               (``ModelRunner.reference_prefill``: the model as kvflow loads it, one transformers forward)
    restore    the restorer (chunks of 256) with recompute and cacheflow, the last 32 tokens the query
    fp64       kvflow's fp32 full prefill against the same model run in float64
    plain      kvflow's fp32 full prefill against plain transformers (the checkpoint loaded by AutoModelForCausalLM:
               MKL linear layers, torch's norms)

KV is every layer's K and V over every position; logits the last position's. ~2.5 min per 8K-token text on 2 cores.
"""

import argparse
import json
import random
import time
from pathlib import Path

import torch

from kvflow import KVPool, Restorer, load_model
from kvflow.cost import CostModel
from kvflow.demo.chat import _text
from kvflow.demo.texts import long_document
from kvflow.engine.model_runner import BatchRunner, StepItem
from kvflow.engine.paged_cache import PagedKVCache
from kvflow.engine.tokenizer import load_tokenizer
from kvflow.model.catalog import checkpoint_dir
from kvflow.threads import in_fresh_thread, use_compute_threads

MODEL = "smollm2-135m"


def kv_diff(a: list, b: list) -> float:
    """Largest |difference| over layers' (k, v) [H, T, D] pairs."""
    return max(max((x.double() - y.double()).abs().max().item() for x, y in zip(p, q)) for p, q in zip(a, b))


def squeeze(kv) -> list:
    return [(k[0], v[0]) for k, v in kv]


def engine_kv(runner, ids: list[int], step: int):
    n, bs = len(ids), 16
    cache = PagedKVCache(runner.num_layers, n // bs + 2, bs, runner.kv_heads, runner.head_dim)
    batch, table = BatchRunner(runner, cache), list(range(n // bs + 2))
    for s in range(0, n, step):
        logits = batch.execute([StepItem(table, s, ids[s:s + step], s + step >= n)])
    kv = [(cache.kv[i, 0, :n].transpose(0, 1).clone(), cache.kv[i, 1, :n].transpose(0, 1).clone())
          for i in range(runner.num_layers)]
    return kv, logits[0]


def fixed_cost(runner) -> CostModel:
    """A fixed cost model (no profiling): the plans follow from it by rule, and exactness must not depend on it."""
    return CostModel(runner.name, runner.fingerprint, 2, a=2e-6, b=2e-8, d=3e-4, e=2e-4, head=1e-4,
                     kv_bytes_per_token_layer=runner.kv_bytes_per_token() // runner.num_layers,
                     num_layers=runner.num_layers)


def restore_kv(runner, ids: list[int], strategies: list[str]) -> dict:
    context, query = torch.tensor(ids[:-32]), torch.tensor(ids[-32:])
    pool = KVPool.memory("2G", chunk_tokens=256, devices=2)
    restorer = Restorer(runner, pool, cost=fixed_cost(runner), calibrate=False)
    restorer.store(context)
    pool.set_throttle(restorer.cost.short_context_rate(256))
    return {s: restorer.restore(context, query, s) for s in strategies}


def point(runner, plain, tokenizer, length: int, text: str, step: int) -> dict:
    ids = long_document(tokenizer, length) if text == "human" else \
        tokenizer.encode(_text(random.Random(int(text)), int(length * 2.2)))[:length]
    assert len(ids) == length, f"text {text} has {len(ids)} tokens, not {length}"
    t0 = time.perf_counter()
    ref_kv, ref_logits = runner.reference_prefill(torch.tensor(ids))
    ref = squeeze(ref_kv)
    kv, logits = engine_kv(runner, ids, step)
    out = {"length": length, "text": text, "step": step,
           "engine_kv": kv_diff(kv, ref), "engine_logits": (logits - ref_logits).abs().max().item(),
           "engine_argmax_equal": int(logits.argmax()) == int(ref_logits.argmax())}
    del kv
    for s, r in restore_kv(runner, ids, ["recompute", "cacheflow"]).items():
        out[f"restore_{s}_kv"] = kv_diff(squeeze(r.kv), ref)
        out[f"restore_{s}_logits"] = (r.logits - ref_logits).abs().max().item()
    with torch.inference_mode():
        p = plain(input_ids=torch.tensor(ids).view(1, -1), use_cache=True, logits_to_keep=1)
        out["plain_kv"] = kv_diff([(x.keys[0], x.values[0]) for x in p.past_key_values.layers], ref)
        out["plain_logits"] = (p.logits[0, -1] - ref_logits).abs().max().item()
        del p
        model = runner.hf_model.to(torch.float64)
        try:
            t = model(input_ids=torch.tensor(ids).view(1, -1), use_cache=True, logits_to_keep=1)
            out["fp64_kv"] = kv_diff([(x.keys[0], x.values[0]) for x in t.past_key_values.layers], ref)
            out["fp64_logits"] = (t.logits[0, -1].double() - ref_logits.double()).abs().max().item()
        finally:
            runner.hf_model.to(torch.float32)
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--texts", default="0,1")
    ap.add_argument("--step", type=int, default=512)
    ap.add_argument("--out", type=Path, default=Path("exactness_depth.json"))
    a = ap.parse_args()
    use_compute_threads()
    from transformers import AutoModelForCausalLM
    runner = load_model(MODEL, dtype="float32")
    tokenizer = load_tokenizer(runner.name, runner.config.vocab_size)
    plain = AutoModelForCausalLM.from_pretrained(checkpoint_dir(MODEL), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    rows = []
    for length in (int(x) for x in a.lengths.split(",")):
        for text in a.texts.split(","):
            rows.append(point(runner, plain, tokenizer, length, text, a.step))
            r = rows[-1]
            print(f"{length:6d} tokens, text {text}: engine {r['engine_kv']:.2e}  restore recompute "
                  f"{r['restore_recompute_kv']:.2e} cacheflow {r['restore_cacheflow_kv']:.2e}  | full prefill "
                  f"against fp64 {r['fp64_kv']:.2e}, against plain transformers {r['plain_kv']:.2e}  "
                  f"(logits: engine {r['engine_logits']:.1e}, fp64 {r['fp64_logits']:.1e})  {r['seconds']:.0f} s",
                  flush=True)
    a.out.write_text(json.dumps({"model": MODEL, "bound": 1e-4, "rows": rows}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    in_fresh_thread(main)
