"""Executor configuration: the ``executor:`` section of a config file, ``KVFLOW_EXECUTOR_*`` env overrides.

    executor:
      stall_timeout_s: 120      # a wait with nothing happening this long is a stall: one KVFlowError, never a hang
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from kvflow.config import check, load_section


@dataclass(slots=True)
class ExecutorConfig:
    stall_timeout_s: float = 120.0   # longest wait for one pool read, one stage input, or the other thread's progress

    def validate(self) -> None:
        check(math.isfinite(self.stall_timeout_s) and self.stall_timeout_s > 0,
              f"executor.stall_timeout_s must be a finite number of seconds > 0, got {self.stall_timeout_s!r}")

    @classmethod
    def load(cls, data: Mapping | None = None, env: Mapping[str, str] | None = None) -> ExecutorConfig:
        """From a parsed config file's ``executor`` section (or none) + ``KVFLOW_EXECUTOR_*`` overrides."""
        return load_section(cls, "executor", data, env)
