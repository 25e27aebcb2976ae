"""The pipeline's communicator: which device each stage computes on and which torch.distributed backend carries the
hidden states between stages (DESIGN.md §4: one of the three places that know a device).

    device cpu                          every stage on the CPU, gloo over 127.0.0.1
    device cuda, >= one GPU per stage   stage g on cuda:g, NCCL (tensors cross GPU to GPU)
    device cuda, fewer GPUs             stage g on cuda:(g mod count), gloo (hidden states cross through the host)
"""

from __future__ import annotations

import torch

from kvflow.model.device import resolve


def stage_device(name: str, rank: int, world: int) -> torch.device:
    device = resolve(name)
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    return torch.device("cuda", rank % count) if world > 1 else device


def backend(name: str, world: int) -> str:
    device = resolve(name)
    return "nccl" if device.type == "cuda" and torch.cuda.device_count() >= world > 1 else "gloo"


def wire_device(backend_name: str, compute: torch.device) -> torch.device:
    """Where a message's tensors must live for ``backend_name``: the GPU for NCCL, the host for gloo."""
    return compute if backend_name == "nccl" else torch.device("cpu")
