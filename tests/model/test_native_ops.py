"""kvflow's native layer ops (native.py, csrc/layer_ops.cpp) give torch's composites' results — rms_norm, the
residual add + rms_norm, the rotation in place, SiLU(gate) * up — on one row, on a prefill's many (the threaded
path), at odd widths and at extreme values; shapes they do not take are a RuntimeError, never a read out of bounds."""

import pytest
import torch
import torch.nn.functional as F

from kvflow import native

pytestmark = pytest.mark.skipif(not native.loaded(), reason="kvflow's native ops are not built here")
ops = torch.ops.kvflow


def _close(want, got):
    assert want.shape == got.shape
    assert (want - got).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1e-6)


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("rows,width", [(1, 576), (300, 576), (7, 100), (3, 13)])
def test_rms_norm_and_the_residual_add_give_torchs(rows, width):
    x, y, w = _rand(1, rows, width), _rand(1, rows, width, seed=1, scale=3), _rand(width, seed=2)
    _close(F.rms_norm(x, (width,), w, 1e-5), ops.rms_norm(x, w, 1e-5))
    s, n = ops.add_rms_norm(x, y, w, 1e-6)
    _close(x + y, s)
    _close(F.rms_norm(x + y, (width,), w, 1e-6), n)


@pytest.mark.parametrize("rows,heads,rotated,d", [(1, 15, 12, 64), (257, 15, 12, 64), (5, 6, 6, 36), (2, 4, 3, 2)])
def test_the_rotation_in_place_gives_rotate_half_bit_for_bit_and_leaves_the_other_heads(rows, heads, rotated, d):
    """Rounded as torch rounds transformers' formula (each product, then the sum: no fused multiply-add), so a
    fused layer and its module rotate alike (model/layer.py, "One computation for every path")."""
    x = _rand(rows, heads, d, scale=3)
    cos, sin = _rand(rows, d, seed=1), _rand(rows, d, seed=2)
    half = d // 2
    part = x[:, :rotated]
    want = part * cos.unsqueeze(1) + torch.cat((-part[..., half:], part[..., :half]), -1) * sin.unsqueeze(1)
    got = x.clone()
    ops.rotary_(got, cos, sin, rotated)
    assert torch.equal(want, got[:, :rotated])
    assert torch.equal(got[:, rotated:], x[:, rotated:])


@pytest.mark.parametrize("rows,inner", [(1, 1536), (64, 1536), (3, 13)])
@pytest.mark.parametrize("scale", [1.0, 40.0])           # 40: gates far past exp's range on both sides
def test_silu_mul_gives_silu_of_the_gate_times_up(rows, inner, scale):
    gu = _rand(1, rows, 2 * inner, scale=scale)
    g, u = gu.split(inner, -1)
    got = ops.silu_mul(gu)
    assert torch.isfinite(got).all()
    _close(F.silu(g) * u, got)


def test_shapes_it_does_not_take_are_an_error():
    x = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="last dimension"):
        ops.rms_norm(x, torch.zeros(9), 1e-5)
    with pytest.raises(RuntimeError, match="same shape"):
        ops.add_rms_norm(x, torch.zeros(2, 9), torch.zeros(8), 1e-5)
    with pytest.raises(RuntimeError, match="D even"):
        ops.rotary_(torch.zeros(2, 3, 5), torch.zeros(2, 5), torch.zeros(2, 5), 2)
    with pytest.raises(RuntimeError, match="heads"):
        ops.rotary_(torch.zeros(2, 3, 4), torch.zeros(2, 4), torch.zeros(2, 4), 4)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        ops.rms_norm(x.t(), torch.zeros(2), 1e-5)
    with pytest.raises(RuntimeError, match="2I"):
        ops.silu_mul(torch.zeros(2, 7))
