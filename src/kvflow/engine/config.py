"""EngineConfig: the ``engine:`` section of a kvflow config file (``KVFLOW_ENGINE_<FIELD>`` overrides)."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.config import _parse_size, check, load_section
from kvflow.planner import STRATEGIES

SCHEDULING_POLICIES = ("fcfs", "first-token", "remaining-work")
AUTO = "auto"


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16                  # tokens per KV block
    kv_budget: int | str = 256 * 2**20    # bytes of resident KV (all blocks), e.g. "64M"; "auto": sized to the model
    #                                       and free memory (reserve.py; kvflow serve's default, where none is given)
    kv_memory_share: float = 0.25         # kv_budget auto: this share of the memory available after the reserve
    num_blocks: int = 0                   # > 0: this many blocks instead of kv_budget / bytes per block
    max_num_batched_tokens: int = 512     # tokens computed per step (prefill chunks + decodes), vLLM's name
    max_num_seqs: int = 64                # running sequences at most
    max_model_len: int = 0                # 0: the model's max_position_embeddings
    enable_prefix_caching: bool = True    # resident blocks shared by chained hash
    chunked_prefill: bool = True          # False: a prompt is admitted only when all of it fits one step
    strategy: str = "cacheflow"           # restoration strategy for pool hits (any of kvflow.planner.STRATEGIES)
    pool_min_tokens: int = 1              # a pool hit must add at least this many tokens over the resident hit
    pool_load: bool = True                # a pool hit may be read straight into blocks when predicted soonest
                                          # (False: only restored by the strategy, as its comparisons need)
    async_restore: bool = False           # True: restore pool hits on a 1-thread worker while steps go on (threads.py)
    scheduling_policy: str = "remaining-work"  # or "first-token", "fcfs": the order of prefills and admissions
    #                                       (scheduler.py); remaining-work and first-token swap decoders for a first token
    max_swaps: int = 3                    # first-token policy: times one sequence may be swapped out for others
    starvation_factor: float = 4.0        # remaining-work policy: a first token within F x its FCFS steps (+1 step)
    write_queue: int = 64                 # pending pool writes at most; a full queue drops (and counts) writes
    activation_reserve: int = 0           # bytes of prefill activations ("64M"); 0: measured at start-up (reserve.py)
    elastic_reserve: bool = False         # lend the prefill activation reserve as KV blocks while only decodes run
    elastic_blocks: int = 0               # > 0: lend this many blocks instead of the reserve's bytes / bytes per block
    release_heap: bool = False            # resident memory held to the live set (reserve.py; on with elastic_reserve)

    @property
    def holds_to_live_set(self) -> bool:
        """The engine's resident memory must stay within its budget: held to the live set (engine/reserve.py)."""
        return self.release_heap or self.elastic_reserve

    @property
    def auto_kv_budget(self) -> bool:
        return self.kv_budget == AUTO and self.num_blocks == 0

    def validate(self) -> None:
        if isinstance(self.kv_budget, str):
            text = self.kv_budget.strip().lower()
            self.kv_budget = AUTO if text == AUTO else _parse_size(self.kv_budget, "engine.kv_budget (bytes or auto)")
        if isinstance(self.activation_reserve, str):
            self.activation_reserve = _parse_size(self.activation_reserve)
        check(self.block_size >= 1, f"engine.block_size must be >= 1, got {self.block_size}")
        check(self.kv_budget == AUTO or self.kv_budget > 0 or self.num_blocks > 0, "engine.kv_budget must be > 0")
        check(0 < self.kv_memory_share <= 0.9, f"engine.kv_memory_share must be in (0, 0.9], got {self.kv_memory_share}")
        check(self.num_blocks >= 0, f"engine.num_blocks must be >= 0, got {self.num_blocks}")
        check(self.max_num_batched_tokens >= 1, "engine.max_num_batched_tokens must be >= 1")
        check(self.max_num_seqs >= 1, "engine.max_num_seqs must be >= 1")
        check(self.max_model_len >= 0, "engine.max_model_len must be >= 0")
        check(self.strategy in STRATEGIES, f"engine.strategy {self.strategy!r}: use one of {', '.join(STRATEGIES)}")
        check(self.scheduling_policy in SCHEDULING_POLICIES, f"engine.scheduling_policy {self.scheduling_policy!r}: "
              f"use one of {', '.join(SCHEDULING_POLICIES)}")
        check(self.max_swaps >= 0, f"engine.max_swaps must be >= 0, got {self.max_swaps}")
        check(self.starvation_factor >= 1, f"engine.starvation_factor must be >= 1, got {self.starvation_factor}")
        check(self.pool_min_tokens >= 1, "engine.pool_min_tokens must be >= 1")
        check(self.write_queue >= 1, "engine.write_queue must be >= 1")
        check(self.activation_reserve >= 0, f"engine.activation_reserve must be >= 0, got {self.activation_reserve}")
        check(self.elastic_blocks >= 0, f"engine.elastic_blocks must be >= 0, got {self.elastic_blocks}")

    @classmethod
    def load(cls, data: dict | None = None, env=None) -> EngineConfig:
        return load_section(cls, "engine", data, env)
