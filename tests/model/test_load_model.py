import pytest

from kvflow import load_model
from kvflow.errors import ModelError


def test_presets_are_deterministic_from_the_seed(tiny):
    assert load_model("tiny", seed=0).fingerprint == tiny.fingerprint
    assert load_model("tiny", seed=1).fingerprint != tiny.fingerprint


def test_layers_suffix_keeps_shape_with_fewer_layers():
    runner = load_model("tiny@layers=2")
    assert runner.num_layers == 2 and runner.hidden_size == 256 and runner.kv_heads == 2
    assert runner.kv_bytes_per_token("float32") == 2 * 2 * 2 * 32 * 4
    assert runner.kv_bytes_per_token("bf16") == runner.kv_bytes_per_token("float32") // 2


def test_local_checkpoint_directory_loads_with_same_fingerprint(tiny, tmp_path):
    tiny.hf_model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.fingerprint == tiny.fingerprint and loaded.num_layers == tiny.num_layers


@pytest.mark.parametrize("name", ["nosuch", "tiny@layers=0", "tiny@layers=99", "tiny@depth=2", "./no/such/dir",
                                  "tiny@", "tiny@layers=²", "tiny@layers=１", "tiny@layers=", "tiny@@", "@"])
def test_bad_model_names_raise_model_error(name):
    """Issue 37: ``tiny@`` was silently ``tiny``; ``tiny@layers=²`` passed str.isdigit() and crashed int()."""
    with pytest.raises(ModelError):
        load_model(name)


def test_bad_dtype_raises_model_error():
    with pytest.raises(ModelError):
        load_model("tiny", dtype="int3")


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelError, match="config.json"):
        load_model(str(tmp_path))
