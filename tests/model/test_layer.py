"""The runner's fused decoder layer (model/layer.py) gives each layer's own output and K/V, is used only where it
does, and leaves the model's own forward (generate, the reference prefill) on the modules."""

import pytest
import torch
import torch.nn.functional as F

from kvflow import native
from kvflow.model import ModelRunner, layer, linear
from tests.conftest import small_runner

pytestmark = pytest.mark.skipif(not linear.available(), reason="this torch build has no oneDNN linear")


def _runner(model_type: str, **extra) -> ModelRunner:
    return small_runner(model_type, layers=2, **extra)


class _Slot:
    def __init__(self):
        self.kv = None

    def update(self, k, v, layer_idx, *args, **kwargs):
        self.kv = (k.clone(), v.clone())
        return k, v


def _run(fn, runner, hidden, start):
    positions = torch.arange(start, start + hidden.shape[1]).view(1, -1)
    slot = _Slot()
    with torch.inference_mode():
        out = fn(hidden, attention_mask=None, position_ids=positions,
                 position_embeddings=runner._base.rotary_emb(hidden, positions), use_cache=True,
                 **{runner._cache_kw: slot})
    return (out[0] if isinstance(out, tuple) else out), slot.kv


@pytest.mark.parametrize("model_type,extra", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 48}),
                                              ("llama", {"attention_bias": True})])
@pytest.mark.parametrize("rows,start", [(1, 0), (1, 300), (9, 0), (64, 17)])
@pytest.mark.parametrize("native_ops", [True, False])
def test_a_fused_layer_gives_its_modules_output_and_kv(model_type, extra, rows, start, native_ops):
    runner = _runner(model_type, **extra)
    assert runner.fused_layers == runner.num_layers
    for fused, module in zip(runner.layers, runner._base.layers):
        assert isinstance(fused, layer.FusedLayer) and fused.layer is module
        assert (fused.ops is not None) == native.loaded()
        if not native_ops:
            fused.ops = None                            # torch's elementwise ops: the path without the library
        hidden = torch.randn(1, rows, 128, generator=torch.Generator().manual_seed(rows + start))
        want, want_kv = _run(module, runner, hidden, start)
        got, got_kv = _run(fused, runner, hidden, start)
        assert (want - got).abs().max().item() <= 1e-5 * want.abs().max().item()
        for w, g in zip(want_kv, got_kv):
            assert w.shape == g.shape and (w - g).abs().max().item() <= 1e-5 * w.abs().max().item()


@pytest.mark.parametrize("model_type,extra", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 48}),
                                              ("llama", {"attention_bias": True})])
@pytest.mark.parametrize("rows,start", [(1, 0), (1, 300), (9, 0), (512, 17)])
def test_a_fused_layer_and_its_module_compute_alike_bit_for_bit(model_type, extra, rows, start):
    """Once fused, the module's norms, rotation and q/k/v compute as the fused layer's (model/layer.py, "One
    computation for every path"): on the same attention the two give the same output and K/V bit for bit, so a
    chunked prefill differs from the full one only by the attention's summation order."""
    runner = _runner(model_type, **extra)
    for fused, module in zip(runner.layers, runner._base.layers):
        hidden = torch.randn(1, rows, 128, generator=torch.Generator().manual_seed(rows + start)) * 3
        want, want_kv = _run(module, runner, hidden, start)
        got, got_kv = _run(fused, runner, hidden, start)
        assert torch.equal(want, got)
        assert all(torch.equal(w, g) for w, g in zip(want_kv, got_kv))


def test_the_models_own_forward_keeps_its_modules():
    runner = _runner("llama")
    for module in runner._base.layers:
        assert "forward" not in vars(module) and "forward" not in vars(module.self_attn)


def test_a_layer_with_parts_it_does_not_know_keeps_its_own_forward():
    runner = _runner("qwen3", head_dim=32)              # q_norm / k_norm in the attention module
    assert runner.fused_layers == 0 and runner.layers == list(runner._base.layers)


def test_a_layer_whose_probe_differs_keeps_its_own_forward():
    runner = _runner("llama")
    module = runner._base.layers[0]
    own = type(module).forward
    module.forward = lambda hidden_states, *a, **k: own(module, hidden_states, *a, **k) + 1.0   # computes otherwise
    norm, k_proj = module.input_layernorm, module.self_attn.k_proj
    norm_forward, k_forward = vars(norm).get("forward"), vars(k_proj).get("forward")
    assert layer.fuse(module, runner._base.rotary_emb, runner._cache_kw) is module
    assert vars(norm).get("forward") is norm_forward and vars(k_proj).get("forward") is k_forward   # as they were


def test_a_norm_that_only_looks_like_llamas_fails_the_probe_and_its_module_stays_as_it_was(monkeypatch):
    """Another formula behind Llama's attributes (Gemma's x * (1 + w)): the probe compares the fused layer with the
    module as loaded, so the layer keeps its own forward and nothing of it is made to compute alike."""
    monkeypatch.setenv("KVFLOW_LINEAR", "torch")
    runner = _runner("llama")                           # loaded with nothing packed or fused
    monkeypatch.delenv("KVFLOW_LINEAR")
    module = runner._base.layers[0]
    norm = module.input_layernorm

    class OnePlusWeight(type(norm)):
        def forward(self, x):
            return F.rms_norm(x, (x.shape[-1],), None, self.variance_epsilon) * (1.0 + self.weight)

    norm.__class__ = OnePlusWeight
    assert layer.fuse(module, runner._base.rotary_emb, runner._cache_kw) is module
    for part in (norm, module.post_attention_layernorm, module.self_attn.k_proj, module.self_attn.q_proj):
        assert "forward" not in vars(part)


def test_no_fusion_on_f_linear_or_under_the_memory_guard(monkeypatch):
    runner = _runner("llama")
    args = (runner._base.layers, runner._base.rotary_emb, runner._cache_kw)
    assert all(isinstance(x, layer.FusedLayer) for x in layer.fuse_layers(*args, free_bytes=None))
    assert layer.fuse_layers(*args, free_bytes=1 << 10) == list(runner._base.layers)
    monkeypatch.setenv("KVFLOW_LINEAR", "torch")
    assert layer.fuse_layers(*args, free_bytes=None) == list(runner._base.layers)
