"""Large host linear layers run through oneDNN with weights packed once (model/linear.py): the same numbers as
F.linear up to summation order, a row's result independent of its batch, the weights and fingerprint untouched,
and a switch back to F.linear."""

import pytest
import torch
import torch.nn.functional as F

from kvflow.errors import ConfigError
from kvflow.model import linear
from kvflow.model.linear import PACK_MIN_ELEMENTS, pack_linears

pytestmark = pytest.mark.skipif(not linear.available(), reason="this torch build has no oneDNN linear")


def layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(576, 1536), torch.nn.Linear(576, 192, bias=False))


def test_large_layers_are_packed_and_agree_with_f_linear_while_small_ones_stay():
    model = layers()
    big, small = model[0], model[1]
    reference = big.weight.detach().clone()
    assert pack_linears(model, free_bytes=None) == big.weight.numel() * 4
    assert "forward" in vars(big) and "forward" not in vars(small)       # 192 x 576 < PACK_MIN_ELEMENTS
    assert small.weight.numel() < PACK_MIN_ELEMENTS <= big.weight.numel()
    x = torch.randn(3, 5, 576)
    with torch.inference_mode():
        out = big(x)
        want = F.linear(x, big.weight, big.bias)
        assert (out - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        rows = torch.randn(512, 576)
        batch = big(rows)
        assert all(torch.equal(big(rows[i:i + 1]), batch[i:i + 1]) for i in (0, 7, 511))   # batch-independent
    assert torch.equal(big.weight, reference) and set(model.state_dict()) == {"0.weight", "0.bias", "1.weight"}


@pytest.mark.parametrize("in_features", [576, 1536, 8192])
def test_a_lone_row_gets_the_bits_it_gets_in_a_batch_whatever_the_weights_input(in_features):
    """oneDNN's one-row path sums a long input (1,536 here) in another order; where the probe at packing finds so,
    a lone row is sent as two (PackedWeight.apply), so a decode, a one-token chunk and a batch give a row its bits."""
    torch.manual_seed(in_features)
    layer = torch.nn.Linear(in_features, 576, bias=False)
    pack_linears(torch.nn.Sequential(layer), free_bytes=None)
    rows = torch.randn(64, in_features)
    with torch.inference_mode():
        batch = layer(rows)
        assert all(torch.equal(layer(rows[i:i + 1]), batch[i:i + 1]) for i in (0, 5, 63))
        assert torch.equal(layer(rows[None, 5:6]), batch[None, 5:6])             # [1, 1, in]: one token


def test_the_switch_the_memory_guard_and_a_bad_value(monkeypatch):
    monkeypatch.setenv("KVFLOW_LINEAR", "torch")
    assert pack_linears(layers(), free_bytes=None) == 0
    monkeypatch.setenv("KVFLOW_LINEAR", "onednn")
    assert pack_linears(layers(), free_bytes=4 * 576 * 1536 * 3) == 0   # a copy over a quarter of the free memory
    monkeypatch.setenv("KVFLOW_LINEAR", "mkl")
    with pytest.raises(ConfigError, match="KVFLOW_LINEAR"):
        pack_linears(layers(), free_bytes=None)


def test_a_loaded_model_packs_and_keeps_its_fingerprint(monkeypatch):
    from kvflow.model import load_model
    packed = load_model("qwen2.5-0.5b@layers=1")
    monkeypatch.setenv("KVFLOW_LINEAR", "torch")
    plain = load_model("qwen2.5-0.5b@layers=1")
    assert packed.packed_linear_bytes > 0 and plain.packed_linear_bytes == 0
    assert packed.fingerprint == plain.fingerprint
    ids = torch.arange(40).view(1, -1)
    with torch.inference_mode():
        a, b = packed.hf_model(ids).logits, plain.hf_model(ids).logits
    assert (a - b).abs().max().item() <= 1e-4 and torch.equal(a.argmax(-1), b.argmax(-1))


class GatedMLP(torch.nn.Module):
    def __init__(self, swapped=False):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(576, 1536, bias=False), torch.nn.Linear(576, 1536, bias=False)
        self.down_proj, self.act_fn, self.swapped = torch.nn.Linear(1536, 576, bias=False), torch.nn.SiLU(), swapped

    def forward(self, x):
        g, u = (self.up_proj(x), self.gate_proj(x)) if self.swapped else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.act_fn(g) * u)


def test_a_gated_mlp_packs_gate_and_up_as_one_weight_with_its_own_output():
    """down(act(gate(x)) * up(x)) with [gate; up] in one packed call: its own forward's output, a row's result
    independent of its batch, the weights untouched; an MLP that computes otherwise keeps its own forward."""
    torch.manual_seed(1)
    mlp, other = GatedMLP(), GatedMLP(swapped=True)
    x = torch.randn(2, 7, 576)
    with torch.no_grad():
        want, want_other = mlp(x), other(x)
    assert pack_linears(mlp, free_bytes=None) == 3 * 576 * 1536 * 4
    assert pack_linears(other, free_bytes=None) == 3 * 576 * 1536 * 4
    assert isinstance(vars(mlp)["forward"], linear.PackedGatedMLP) and "forward" not in vars(mlp.gate_proj)
    assert "forward" not in vars(other) and "forward" in vars(other.gate_proj)     # packed one by one
    with torch.inference_mode():
        got, got_other = mlp(x), other(x)
        rows = torch.randn(64, 576)
        batch = mlp(rows)
        assert all(torch.equal(mlp(rows[i:i + 2]), batch[i:i + 2]) for i in (0, 62))   # (a lone row: docstring)
    for a, b in ((got, want), (got_other, want_other)):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)                          # an in-place write repacks
        assert (mlp(x) - GatedMLP.forward(mlp, x)).abs().max().item() <= 1e-5 * want.abs().max().item() * 2
