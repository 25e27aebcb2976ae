"""On a CUDA device (``pytest -m cuda``; skipped without one): every strategy restores the KV and logits of one full
prefill on the same device in the same dtype, pool loads cross on the transfer stream while the compute stream
works, and the pinned staging buffers are reused.

Tolerances: fp32 with TF32 off, max abs diff <= 1e-4 on KV and logits and the same argmax (the CPU's bar). bf16:
max abs diff <= 2e-2 on the logits and <= 2e-2 x max|KV| on the KV (bf16 keeps 8 mantissa bits: a chunked
recompute rounds differently from one full pass), and the same argmax wherever the reference's top two logits are
further apart than that tolerance (random weights give near-ties a rounding may flip)."""

import pytest
import torch

from kvflow import KVPool, Restorer
from kvflow.model import load_model
from kvflow.model.device import cuda_available
from kvflow.planner import STRATEGIES
from tests.conftest import max_abs_diff_kv
from tests.model.test_device import staging_stays_flat
from tests.restore.test_restore_exactness import ids, synthetic_cost

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def gpu_model(request):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return load_model("qwen2.5-0.5b@layers=2", device="cuda", dtype=request.param)


def check(runner, out, context, query):
    ref_kv, ref_logits = runner.reference_prefill(torch.cat([context, query]))
    assert out.logits.device.type == "cpu" and out.kv[0][0].device.type == "cuda"
    if runner.dtype == torch.float32:
        assert max_abs_diff_kv(out.kv, ref_kv) <= 1e-4
        assert (out.logits - ref_logits).abs().max().item() <= 1e-4
        assert out.logits.argmax() == ref_logits.argmax()
        return
    scale = max(k.float().abs().max().item() for layer in ref_kv for k in layer)
    assert max_abs_diff_kv(out.kv, ref_kv) <= 2e-2 * scale
    assert (out.logits - ref_logits).abs().max().item() <= 2e-2
    top2 = ref_logits.topk(2).values
    if top2[0] - top2[1] > 2e-2:
        assert out.logits.argmax() == ref_logits.argmax()


@pytest.mark.parametrize("n,chunk,rho", [(700, 64, None), (1500, 128, 1.0), (2048, 256, 8.0)])
def test_every_strategy_on_the_device_equals_its_full_prefill(gpu_model, n, chunk, rho):
    pool = KVPool.memory("512M", chunk_tokens=chunk, devices=2)
    restorer = Restorer(gpu_model, pool, cost=synthetic_cost(gpu_model))
    context, query = ids(n, n), ids(9, n + 1)
    restorer.store(context)
    if rho is not None:
        pool.set_throttle(rho * restorer.cost.short_context_rate(chunk))
    for strategy in STRATEGIES:
        check(gpu_model, restorer.restore(context, query, strategy), context, query)


def test_loads_cross_on_the_transfer_stream_while_the_device_computes(gpu_model):
    pool = KVPool.memory("512M", chunk_tokens=128, devices=2)
    restorer = Restorer(gpu_model, pool)                       # the device's own profile
    context, query = ids(8192, 1), ids(8, 2)
    restorer.store(context)
    pool.set_throttle(restorer.cost.short_context_rate(128))   # rho = 1: both sides busy
    transfer = restorer.executor.transfer
    transfer.trace = []
    out = restorer.restore(context, query, "token")
    copies = transfer.trace
    computes = [(e.start, e.end) for e in out.timeline if e.kind == "compute"]
    assert copies and computes and transfer.copies >= len(copies)
    overlapping = [c for c in copies if any(a < c[1] and c[0] < b for a, b in computes)]
    assert overlapping, "no host-to-device copy ran while a compute step did"
    check(gpu_model, out, context, query)


def test_pinned_staging_buffers_are_reused_over_100_restores(gpu_model):
    staging, out, context, query = staging_stays_flat(gpu_model, 64, 1024, 5)
    assert staging.pinned
    check(gpu_model, out, context, query)
