"""Where a model computes: the host CPU (fp32 by default) or one CUDA device (bf16 by default).

    resolve("cuda:1")   -> torch.device("cuda", 1), or one ModelError line when torch has no such device
    default_dtype(dev)  -> fp32 on the CPU (exact, and bf16 is 3-7x slower without AVX-512), bf16 on CUDA
    default_device()    -> $KVFLOW_DEVICE, else what :func:`set_default_device` chose (``kvflow --device``), else cpu
    synchronize(dev)    -> wait for the device's queued work (a no-op on the CPU)

Names: ``cpu``, ``cuda`` (the current CUDA device), ``cuda:N``, ``auto`` (cuda when torch sees one, else cpu).
Device specifics live in three places only (DESIGN.md §4): the model runner (weights and caches), the executor's
transfer side (executor/transfer.py) and the pipeline's communicator. The planner never sees a device.
"""

from __future__ import annotations

import os

import torch

from kvflow.errors import ModelError

ENV = "KVFLOW_DEVICE"
_default: str | None = None


def resolve(name: str | torch.device | None = None) -> torch.device:
    """A torch device kvflow can compute on; ModelError (one line) for an unknown name or a device torch lacks."""
    if isinstance(name, torch.device):
        text = str(name)
    else:
        text = (name if name is not None else default_device()).strip().lower()
    if text == "auto":
        return torch.device("cuda") if cuda_available() else torch.device("cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ModelError(f"device {text!r}: use cpu, cuda, cuda:N or auto") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ModelError(f"device {text!r}: kvflow runs on cpu or cuda, not {device.type}")
    if not cuda_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ModelError(f"device {text!r}: torch {torch.__version__} sees no CUDA device ({built}); use --device "
                         "cpu, or install the CUDA build of torch (README, 'On a GPU machine')")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ModelError(f"device {text!r}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
                         f"(cuda:0 .. cuda:{count - 1})")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def default_device() -> str:
    return os.environ.get(ENV, "").strip() or _default or "cpu"


def set_default_device(name: str) -> torch.device:
    """The device every model of this process (and of the processes it starts: via $KVFLOW_DEVICE) loads on."""
    global _default
    device = resolve(name)
    _default = str(device)
    os.environ[ENV] = _default
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
