"""Device placement on a machine without CUDA: names resolve or fail in one line, the CPU stays fp32, no host tensor
enters the arithmetic of a model placed elsewhere (the meta device stands in for an accelerator: a host tensor
mixed into its ops raises), and the executor's staging buffers are reused, not made per read."""

import subprocess
import sys

import pytest
import torch

from kvflow import KVPool, Restorer
from kvflow.cli.main import take_device
from kvflow.cost import CostModel
from kvflow.engine.model_runner import BatchRunner, StepItem
from kvflow.engine.paged_cache import PagedKVCache
from kvflow.errors import ModelError
from kvflow.executor.transfer import Staging
from kvflow.model import load_model, resolve_device
from kvflow.model.device import cuda_available, default_dtype
from kvflow.model.runner import ModelRunner
from tests.restore.test_restore_exactness import assert_exact, ids, synthetic_cost

no_cuda = pytest.mark.skipif(cuda_available(), reason="this machine has CUDA")


def test_cpu_and_auto_resolve_to_the_host_in_fp32_here():
    assert resolve_device("cpu") == torch.device("cpu")
    if not cuda_available():
        assert resolve_device("auto") == torch.device("cpu")
    assert default_dtype(torch.device("cpu")) == torch.float32
    assert default_dtype(torch.device("cuda", 0)) == torch.bfloat16


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:1", "CUDA:0"])
def test_a_cuda_device_torch_lacks_is_one_model_error_naming_the_fix(name):
    with pytest.raises(ModelError, match="sees no CUDA device.*--device cpu"):
        resolve_device(name)


@pytest.mark.parametrize("name", ["tpu", "gpu", "cuda:x", ""])
def test_an_unknown_device_name_is_one_model_error(name):
    with pytest.raises(ModelError, match="device"):
        resolve_device(name or " ")


def test_the_device_option_is_taken_wherever_it_stands():
    assert take_device(["--device", "cuda", "bench", "restore"]) == (["bench", "restore"], "cuda")
    assert take_device(["bench", "restore", "--device=cuda:1", "--quick"]) == (["bench", "restore", "--quick"],
                                                                              "cuda:1")
    assert take_device(["models"]) == (["models"], None)


@no_cuda
@pytest.mark.parametrize("argv", [["--device", "cuda", "models"], ["models", "--device=cuda:2"]])
def test_kvflow_on_a_missing_gpu_exits_2_with_one_line(argv):
    out = subprocess.run([sys.executable, "-m", "kvflow", *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "no CUDA device" in out.stderr, out.stderr


def test_load_model_places_weights_and_caches_on_its_device_in_its_default_dtype(tiny):
    runner = load_model("tiny", device="cpu")
    assert runner.device == torch.device("cpu") and runner.dtype == torch.float32
    assert runner.new_cache(8).device == torch.device("cpu")
    assert runner.fingerprint == tiny.fingerprint     # weights are drawn on the host whatever the device


def _on_meta(tiny) -> ModelRunner:
    from copy import deepcopy
    return ModelRunner(deepcopy(tiny.hf_model).to("meta"), "tiny@meta")


def test_no_host_tensor_enters_a_restoration_step_on_another_device(tiny):
    runner = _on_meta(tiny)
    assert runner.device.type == "meta" and runner.new_cache(4).device.type == "meta"
    cache = runner.new_cache(1200)
    runner.run_layers(cache, runner.embed(torch.arange(1000) % 97), 0, (0, runner.num_layers))   # from 0: causal
    runner.run_layers(cache, runner.embed(torch.arange(100)), 1000, (0, runner.num_layers))     # a later chunk
    runner.run_layers(cache, runner.embed(torch.arange(1)), 1100, (0, 1))                       # one query token
    stage_input = torch.zeros(1, 16, runner.hidden_size)                                         # fp32, host
    assert runner.run_layers(cache, stage_input, 1101, (1, runner.num_layers)).device.type == "meta"


def test_no_host_tensor_enters_an_engine_step_on_another_device(tiny):
    runner = _on_meta(tiny)
    cache = PagedKVCache(runner.num_layers, 100, 16, runner.kv_heads, runner.head_dim, runner.dtype, device="meta")
    assert cache.kv.device.type == "meta" and cache.slots([3, 4], 0, 20).device.type == "meta"
    step = [StepItem(list(range(50)), 0, list(range(700)), False),          # a prefill from 0
            StepItem(list(range(50, 100)), 790, [1], False),                # a long decode (two matmuls)
            StepItem(list(range(60, 70)), 100, list(range(30)), False)]     # a chunk after a prefix (masked)
    BatchRunner(runner, cache).execute(step)
    cache.copy_blocks([1, 2], [3, 4])


def test_staging_hands_back_the_buffer_of_any_view_and_reuses_it():
    staging = Staging()
    a = staging.take(10_000)
    assert a.data_ptr() % 4096 == 0 and a.numel() == 10_000
    staging.give(a[64:128])                          # a view of it, as a decoded record is
    b = staging.take(9_000)                          # same page-rounded size: the same buffer
    assert b.data_ptr() == a.data_ptr() and staging.allocated == 1
    staging.give(torch.empty(8))                     # a tensor it never handed out: ignored
    assert staging.outstanding == 1
    staging.give(b)
    assert staging.outstanding == 0


def staging_stays_flat(runner, chunk: int, n: int, seed: int):
    """A context of ``n`` tokens stored in chunks of ``chunk`` (records of one size), restored 100 times by four
    strategies: a staging buffer is made only while every one is out (made = the most out at once, however the
    plans and their reads in flight vary), never more than the context's records, and none is left out. Returns
    (the staging, the last result, context, query)."""
    restorer = Restorer(runner, KVPool.memory("256M", chunk_tokens=chunk, devices=2), cost=synthetic_cost(runner))
    context, query = ids(n, seed), ids(4, seed + 1)
    restorer.store(context)
    staging = restorer.executor.transfer.staging
    strategies = ("load", "cacheflow", "token", "cake")
    for i in range(100):
        out = restorer.restore(context, query, strategies[i % 4])
        assert staging.outstanding == 0
    assert 0 < staging.allocated == staging.peak <= (n // chunk) * runner.num_layers
    return staging, out, context, query


def test_restores_read_into_reused_staging_buffers_that_do_not_grow(tiny):
    staging, out, context, query = staging_stays_flat(tiny, 32, 256, 3)
    assert_exact(tiny, out, context, query)


def test_a_cuda_profile_is_its_own_file_and_prices_the_copy_in_series():
    from kvflow.cost.model import default_profile_path
    cpu = default_profile_path("tiny", "ab" * 8, 2)
    gpu = default_profile_path("tiny", "ab" * 8, 2, "cuda:0")
    assert cpu != gpu and cpu.name == f"tiny-{'ab' * 6}-2t.json" and "cuda0" in gpu.name
    cost = CostModel("m", "f", 1, 1e-6, 0, 0, 0, 0, 64, 2)
    assert cost.loaded_rate(1e9) == 1e9                                  # the host copies nothing
    cost.h2d_bytes_per_s = 3e9
    assert cost.loaded_rate(1e9) == pytest.approx(0.75e9)                # 1 / (1/link + 1/copy)
    assert cost.loaded_rate(float("inf")) == pytest.approx(3e9)          # unthrottled: the copy alone


def test_a_read_that_did_not_use_its_staging_buffer_hands_it_back(tiny, monkeypatch):
    restorer = Restorer(tiny, KVPool.memory("64M", chunk_tokens=32), cost=synthetic_cost(tiny))
    context = ids(64, 7)
    restorer.store(context)
    keys = [k for row in restorer.keys(context) for k in row]
    staging = Staging()
    got = restorer.pool.get_many(keys, staging=staging)
    assert staging.outstanding == len(keys)                  # every record a view of its buffer
    for tensor in got.values():
        staging.give(tensor)
    device = restorer.pool.slots[0].device
    inner = getattr(device, "inner", device)
    own = inner.read
    monkeypatch.setattr(inner, "read", lambda offset, length, out=None: own(offset, length))   # a buffer of its own
    got = restorer.pool.get_many(keys, staging=staging)
    assert all(t is not None for t in got.values()) and staging.outstanding == 0
