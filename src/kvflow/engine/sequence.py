"""Sequence: one request inside the engine — its tokens, its blocks, how far its KV is computed, why it stopped."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from kvflow.engine.sampling import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True)
class Sequence:
    """``token_ids`` = prompt + generated tokens. KV exists for ``token_ids[:num_computed]``; the last generated
    token's KV is computed by the next decode step. Block ``i`` of ``block_table`` holds positions
    ``[i * block_size, (i + 1) * block_size)``."""
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)   # chained hashes of the full, computed blocks
    prefix_hashes: list[bytes] = field(default_factory=list)  # ... of its tokens' full blocks (BlockManager.match)
    num_computed: int = 0
    resident_hit_tokens: int = 0     # prompt tokens whose KV came from resident blocks (first admission)
    pool_hit_tokens: int = 0         # ... restored from the pool
    pool_restore: int = 0            # at admission: tokens [0, pool_restore) to restore from the pool this step
    pool_load: int = 0               # ... or tokens [num_computed, pool_load) to read into its blocks (a load)
    restoring: bool = False          # a pool restoration of this sequence is in flight (async_restore)
    abort_pending: bool = False      # aborted while restoring: freed when the restoration returns
    num_preemptions: int = 0          # preempted or swapped out, any number of times
    num_swaps: int = 0                # ... swapped out for another request's first token (first-token policy)
    work: float | None = None         # remaining-work policy: predicted work to its first token (None: not ranked yet)
    work_tokens: int = -1             # ... its uncached tokens when first ranked (the aging threshold's unit)
    hit_tokens: int = 0               # ... its cached prefix (resident or pool) when last ranked
    resident_tokens: int = 0          # ... its resident hit when ``work`` was predicted
    stored_tokens: int = 0            # ... its pool hit, looked up when first ranked (after a preemption: again)
    ranked_at: int = -1               # ... the block manager's version when its resident hit was last matched
    passed_over: int = 0              # ... prefill tokens given to later arrivals while it had no token
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_text: str | None = None       # the stop string that ended it, if any
    text: str = ""                     # detokenized output so far (stop strings are cut off)
    generator: torch.Generator | None = None
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    last_token_s: float | None = None
    admitted_once: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def remaining(self) -> int:
        """Tokens whose KV is still to compute before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
