"""Bounds that command-line values share across commands, beyond what their type says. A value outside them is a
typo (``--seed 99999999999999999999``, ``--rho inf``), refused as one line before any work starts."""

from __future__ import annotations

import typer

MAX_SEED = 2**63 - 1      # torch.manual_seed takes a signed 64-bit value; numpy and random take any non-negative one
MAX_RHO = 1000.0          # I/O-to-compute ratio of a throttled link: at 1000x the link is no longer what limits


def seed_option(help: str | None = None):
    """``--seed``: 0 .. 2**63-1."""
    return typer.Option(0, "--seed", min=0, max=MAX_SEED, help=help)
