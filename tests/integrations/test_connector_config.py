"""The connector's settings: kv_connector_extra_config keys, KVFLOW_CONNECTOR_* env, the pool from a file or inline."""

import pytest

from kvflow.errors import ConfigError, KVFlowError
from kvflow.integrations.vllm import ConnectorConfig

POOL = {"chunk_tokens": 256, "devices": [{"type": "memory", "capacity": "64M"}]}


def test_defaults_load_and_save_with_no_threshold():
    cfg = ConnectorConfig.from_extra({}, env={})
    assert cfg.load and cfg.save and cfg.min_tokens == 0 and cfg.fingerprint is None


def test_extra_config_keys_are_parsed_and_typed():
    cfg = ConnectorConfig.from_extra({"pool": POOL, "min_tokens": "512", "save": "false", "load_threads": 4}, env={})
    assert cfg.min_tokens == 512 and cfg.save is False and cfg.load_threads == 4
    assert cfg.pool_config(env={}).chunk_tokens == 256


def test_env_overrides_extra_config():
    cfg = ConnectorConfig.from_extra({"min_tokens": 1}, env={"KVFLOW_CONNECTOR_MIN_TOKENS": "1024", "KVFLOW_CONNECTOR_LOAD": "0"})
    assert cfg.min_tokens == 1024 and cfg.load is False


def test_the_pool_comes_from_a_kvflow_config_file(tmp_path):
    path = tmp_path / "kvflow.yaml"
    path.write_text("pool:\n  chunk_tokens: 128\n  devices:\n    - {type: memory, capacity: 64M}\n")
    assert ConnectorConfig.from_extra({"config": str(path)}, env={}).pool_config(env={}).chunk_tokens == 128
    assert ConnectorConfig.from_extra({}, env={}).pool_config(env={"KVFLOW_CONFIG": str(path)}).chunk_tokens == 128


def test_env_overrides_the_pool_section_too(monkeypatch):
    monkeypatch.setenv("KVFLOW_POOL_CHUNK_TOKENS", "512")
    assert ConnectorConfig.from_extra({"pool": POOL}, env={}).pool_config().chunk_tokens == 512


@pytest.mark.parametrize("extra,message", [
    ({"min_tokenz": 1}, "unknown key 'min_tokenz'"),
    ({"min_tokens": -1}, "min_tokens: must be >= 0"),
    ({"fingerprint": "xyz"}, "32 hex digits"),
    ({"load": "maybe"}, "expected true/false"),
    ({"config": "a.yaml", "pool": POOL}, "not both"),
    ({"load_threads": 0}, "load_threads"),
])
def test_bad_settings_are_one_line_naming_the_key(extra, message):
    with pytest.raises(ConfigError, match=message) as err:
        ConnectorConfig.from_extra(extra, env={})
    assert "\n" not in str(err.value)


def test_no_pool_anywhere_says_how_to_configure_one():
    with pytest.raises(ConfigError, match="no pool configured"):
        ConnectorConfig.from_extra({}, env={}).pool_config(env={})


def test_a_missing_config_file_is_named():
    with pytest.raises(ConfigError, match="not found"):
        ConnectorConfig.from_extra({"config": "/nonexistent/kvflow.yaml"}, env={}).pool_config(env={})


def test_a_pool_without_an_index_cannot_be_shared_by_vllms_two_processes():
    from kvflow.integrations.vllm import SchedulerSide
    cfg = ConnectorConfig.from_extra({"pool": POOL}, env={})
    with pytest.raises(ConfigError, match="needs index_dir"):
        SchedulerSide(cfg, cfg.pool_config(env={}), "ab" * 16, 4, 128)


def test_the_module_imports_without_vllm_and_the_connector_says_it_needs_it():
    import kvflow.integrations.vllm as connector
    if connector.HAVE_VLLM:
        pytest.skip("vLLM is installed in this environment")
    with pytest.raises(KVFlowError, match="runs inside vLLM"):
        connector.KVFlowConnector(None, None, None)
