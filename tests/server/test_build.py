"""`kvflow serve`'s config: the engine: section fills EngineConfig (env overrides too), a pool: section turns the
pool tier on, and a bad key is one ConfigError."""

import pytest

from kvflow.errors import ConfigError
from kvflow.server import build_engine
from tests.engine.helpers import synthetic_cost


def test_engine_and_pool_sections_configure_the_server(tiny, tmp_path, monkeypatch):
    cfg = tmp_path / "kvflow.yaml"
    cfg.write_text("engine:\n  block_size: 8\n  kv_budget: 2M\n  strategy: load\n"
                   "pool:\n  chunk_tokens: 32\n  devices:\n    - {type: memory, capacity: 16M}\n")
    monkeypatch.setenv("KVFLOW_ENGINE_MAX_NUM_BATCHED_TOKENS", "64")
    engine, tok = build_engine("tiny", str(cfg), cost=synthetic_cost(tiny))
    assert engine.config.block_size == 8 and engine.config.max_num_batched_tokens == 64
    assert engine.pool is not None and engine.pool.strategy == "load" and engine.pool.chunk_tokens == 32
    assert tok.kind == "bytes" and engine.num_blocks == (2 << 20) // (8 * tiny.kv_bytes_per_token())
    engine.close()


def test_no_pool_section_serves_from_resident_blocks_only(tmp_path):
    cfg = tmp_path / "kvflow.toml"
    cfg.write_text("[engine]\nblock_size = 4\nkv_budget = \"1M\"\n")
    engine, _ = build_engine("tiny", str(cfg))
    assert engine.pool is None and engine.config.block_size == 4


@pytest.mark.parametrize("text", ["engine:\n  block_sise: 8\n", "engine:\n  strategy: magic\n",
                                  "engine:\n  max_num_batched_tokens: 0\n"])
def test_a_bad_engine_config_is_one_config_error(tmp_path, text):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError):
        build_engine("tiny", str(cfg))


@pytest.mark.parametrize("elastic,order", [(False, ["load"]), (True, ["hold", "load"])])
def test_an_elastic_server_holds_memory_to_the_live_set_before_the_model_loads(monkeypatch, elastic, order):
    """So the model's load leaves no heap holes for served steps to reuse (model/host_memory.py)."""
    import kvflow
    from kvflow.model import host_memory
    calls = []

    class Loaded(Exception):
        pass

    def load(*a, **k):
        calls.append("load")
        raise Loaded
    monkeypatch.setattr(host_memory, "hold_to_live_set", lambda: calls.append("hold"))
    monkeypatch.setattr(kvflow, "load_model", load)
    with pytest.raises(Loaded):
        build_engine("tiny", {"engine": {"kv_budget": "1M"}}, elastic_reserve=elastic)
    assert calls == order
