"""StageLink: what the executor asks of a pipeline stage (implementations: kvflow.pipeline.links)."""

from __future__ import annotations

import torch


class StageLink:
    """Where a pipeline stage's hidden states come from and go to (the executor calls these on its compute thread,
    one call at a time). Subclasses implement ``inputs``; the others are optional."""

    def inputs(self, a: int, b: int) -> torch.Tensor | None:
        """Hidden states entering the stage's first layer for tokens [a, a + t), 0 < t <= b - a; may wait for them.
        A shorter answer (or None) means nothing beyond it will come: the compute side stops there."""
        raise NotImplementedError

    def output(self, a: int, hidden: torch.Tensor) -> None:
        """Hidden states leaving the stage's last layer for tokens [a, a + T) (grid steps through every layer)."""

    def grid_computed(self) -> None:
        """The compute side will run no more grid steps for this job."""
