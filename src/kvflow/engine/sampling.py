"""SamplingParams: how one request's next tokens are chosen and when it stops; validated on construction.

temperature 0 (the default) is greedy: argmax, exactly what ``model.generate(do_sample=False)`` picks. Otherwise
logits / temperature, then top-k, then top-p (nucleus), then one draw from the request's own ``torch.Generator``
(seeded from ``seed`` when given, so a seeded request draws the same tokens wherever it runs in a batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow.errors import KVFlowError


class SamplingError(KVFlowError):
    """A sampling value out of range (the server answers 400)."""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                     # 0 or -1: no top-k
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False           # when False the model's eos token ids stop the request too

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop, self.stop_token_ids = list(self.stop or []), list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise SamplingError(msg)
        need(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        need(_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
             f"temperature must be in [0, 100], got {self.temperature!r}")
        need(_number(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1,
             f"top_k must be an integer >= -1 (0 or -1: off), got {self.top_k!r}")
        need(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                   and 0 <= self.seed < 2**63),
             f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        need(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        need(all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 16,
             f"stop must be up to 16 non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from next-token ``logits`` [vocab] (fp32); never fails on an in-range parameter.

    Numerically safe for every value ``validate`` admits: scores are shifted so the largest is 0 and divided in
    fp64 (temperature 1e-300 sends every other token to -inf instead of making inf - inf), top-p keeps at least the
    most likely token (top_p 1e-300 is 0 in fp32), and a distribution that is still not finite falls back to argmax.
    """
    if params.greedy:
        return int(logits.argmax())
    scores = logits.double()
    scores = (scores - scores.max()) / params.temperature
    if params.top_k > 0 and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        order = torch.argsort(scores, descending=True)
        probs = torch.softmax(scores[order], dim=-1)
        drop = probs.cumsum(-1) - probs >= params.top_p        # keep the smallest prefix reaching top_p
        drop[0] = False
        scores[order[drop]] = float("-inf")
    probs = torch.softmax(scores, dim=-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return int(logits.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))
