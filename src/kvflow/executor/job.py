"""The executor's values: what it is given to run (Job) and what it gives back (Execution)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvflow.chunks.keys import ChunkKey
from kvflow.executor.timeline import Event, Timings
from kvflow.model.runner import KVCache
from kvflow.planner.plan import Plan

if TYPE_CHECKING:
    from kvflow.pipeline.stage_link import StageLink


@dataclass
class Job:
    """One request to run: its plan, its record keys ``keys[i][plan layer]``, and context + query token ids.
    With ``link`` the job is a pipeline stage (see StageLink): grid only, no query."""
    plan: Plan
    keys: list[list[ChunkKey]]
    token_ids: torch.Tensor
    cache: KVCache | None = None
    link: StageLink | None = None

    def model_layers(self, layers: tuple[int, int]) -> tuple[int, int]:
        """Plan layers -> model layers (a stage's plan starts at its ``layer_offset``)."""
        return layers[0] + self.plan.layer_offset, layers[1] + self.plan.layer_offset


@dataclass
class Execution:
    cache: KVCache
    logits: torch.Tensor | None           # None for a pipeline stage (its caller runs the query)
    timeline: list[Event]
    timings: Timings
    fallback_chunks: list[int] = field(default_factory=list)
    complete_chunks: int | None = None    # grid chunks [0, n) filled; < num_chunks only when a stage lacked inputs
