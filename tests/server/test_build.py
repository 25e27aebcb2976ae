"""`kvflow serve`'s config: the engine: section fills EngineConfig (env overrides too), a pool: section turns the
pool tier on, and a bad key is one ConfigError."""

import shutil

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


@pytest.mark.parametrize("key", ["", "   ", " key", "key\t"])
def test_an_empty_or_padded_api_key_is_a_config_error_not_authentication_turned_off(key):
    from kvflow.server.build import check_api_key
    with pytest.raises(ConfigError):
        check_api_key(key)
    assert check_api_key(None) is None and check_api_key("k") == "k"


@pytest.mark.parametrize("env", [{"KVFLOW_API_KEY": ""}, {}])
def test_kvflow_serve_with_an_empty_api_key_is_one_line_and_exit_2(tmp_path, env):
    import os
    import subprocess
    import sys
    args = [] if env else ["--api-key", ""]
    r = subprocess.run([sys.executable, "-m", "kvflow", "serve", "--port", "1", *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "empty" in r.stderr


@pytest.mark.parametrize("text", ["engin:\n  block_size: 8\n", "server:\n  max_prompts: 0\n", "engine: 5\n",
                                  "server:\n  max_body_bytes: 10\n", "server:\n  max_json_depth: 100000\n"])
def test_a_bad_section_of_the_server_config_is_one_config_error(tmp_path, text):
    from kvflow.server.build import read_config
    from kvflow.server.limits import ServerLimits
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError):
        ServerLimits.load({"server": read_config(str(cfg)).get("server") or {}})


def test_the_default_pool_is_sized_to_the_model_within_bounds_and_an_existing_file_keeps_its_size(tmp_path):
    from types import SimpleNamespace

    from kvflow.server.build import POOL_BOUNDS, default_pool_capacity
    model = lambda positions, per_token: SimpleNamespace(max_positions=positions,                 # noqa: E731
                                                         kv_bytes_per_token=lambda: per_token)
    path = tmp_path / "kv.img"
    assert default_pool_capacity(model(8192, 46080), path) == min(8 * 8192 * 46080 >> 20 << 20,
                                                                  int(shutil.disk_usage(tmp_path).free * 0.1) >> 20 << 20)
    assert default_pool_capacity(model(2048, 1024), path) <= POOL_BOUNDS[0]          # a small model: the floor
    assert default_pool_capacity(model(2**20, 2**20), path) <= POOL_BOUNDS[1]         # a huge one: the ceiling
    path.write_bytes(b"x")
    assert default_pool_capacity(model(8192, 46080), path) is None


def test_a_server_config_without_a_kv_budget_sizes_it_to_free_memory(monkeypatch):
    import kvflow.model.runner
    monkeypatch.setattr(kvflow.model.runner, "free_memory", lambda device: 64 * 2**20)
    engine, _ = build_engine("tiny", {"engine": {"max_num_batched_tokens": 64, "max_model_len": 4096}})
    assert engine.kv_sizing is not None and engine.kv_sizing.available == 64 * 2**20
