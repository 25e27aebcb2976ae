"""The dtypes kvflow names, in one table: name <-> short name <-> torch dtype <-> bytes per element.

    name       short   torch            bytes   computes / stores
    float32    fp32    torch.float32    4       yes (the exact path)
    bfloat16   bf16    torch.bfloat16   2       yes
    float16    fp16    torch.float16    2       yes
    float8     fp8     float8_e4m3fn    1       no: a KV size the advisor prices, never a dtype kvflow runs in
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.errors import ConfigError, ModelError


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    short: str
    torch: torch.dtype
    itemsize: int
    computes: bool = True


TABLE = (DType("float32", "fp32", torch.float32, 4), DType("bfloat16", "bf16", torch.bfloat16, 2),
         DType("float16", "fp16", torch.float16, 2), DType("float8", "fp8", torch.float8_e4m3fn, 1, computes=False))
NAMED = {alias: d for d in TABLE for alias in (d.short, d.name)}
TORCH = {d.name: d.torch for d in TABLE if d.computes}         # what tensors are computed and stored in


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype kvflow computes or stores in, by either name (or a torch dtype as it is); ModelError otherwise."""
    if isinstance(name, torch.dtype):
        return name
    d = NAMED.get(name)
    if d is None or not d.computes:
        raise ModelError(f"unknown dtype {name!r}: use one of {', '.join(TORCH)}")
    return d.torch


def itemsize(dtype: str | torch.dtype) -> int:
    """Bytes per element of any dtype of the table (fp8 too), by name or torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    return sized(dtype, "dtype")


def sized(name: str, what: str) -> int:
    """Bytes per element of a dtype named on the command line (``what``: the option); ConfigError otherwise."""
    if name not in NAMED:
        raise ConfigError(f"{what} {name!r}: use one of {', '.join(NAMED)}")
    return NAMED[name].itemsize
