"""The Python API the restorer uses: put_many / get_many / contains / longest_prefix / stats, in memory and on
disk, read-only openers in other processes, config errors as one clear line."""

import subprocess
import sys
import textwrap

import pytest
import torch

from kvflow import chunks
from kvflow.errors import ConfigError, KVFlowError
from kvflow.pool import KVPool, PoolConfig

from .helpers import FP, context_keys, device_cfg, tensor_for


def test_what_was_put_is_got_back_exactly_and_owns_its_memory():
    keys = context_keys(6, groups=[(0, 2), (2, 4)])
    with KVPool.memory("8M", devices=2) as pool:
        assert pool.put_many({k: tensor_for(k) for k in keys}) == len(keys)
        got = pool.get_many(keys)
        assert all(torch.equal(got[k], tensor_for(k)) for k in keys)
        again = pool.get_many(keys[:1])[keys[0]]
        got[keys[0]].zero_()                                      # the caller owns its tensors
        assert torch.equal(again, tensor_for(keys[0]))
        assert pool.contains(keys + context_keys(1, seed=9)) == [True] * len(keys) + [False]


def test_unknown_keys_are_misses_not_errors():
    with KVPool.memory("1M") as pool:
        key = context_keys(1)[0]
        assert pool.get_many([key]) == {key: None}
        assert pool.stats()["misses"] == 1


def test_storage_dtype_is_kept_and_values_are_the_cast():
    key = context_keys(1)[0]
    x = tensor_for(key)
    with KVPool.memory("1M", storage_dtype="bfloat16") as pool:
        pool.put_many({key: x})
        out = pool.get_many([key])[key]
        assert out.dtype == torch.bfloat16 and torch.equal(out, x.to(torch.bfloat16))
        other = context_keys(1, seed=3)[0]
        pool.put_many({other: x}, dtype=torch.float16)
        assert pool.get_many([other])[other].dtype == torch.float16


def test_putting_a_stored_key_again_keeps_the_stored_record():
    key = context_keys(1)[0]
    with KVPool.memory("1M") as pool:
        assert pool.put_many({key: tensor_for(key)}) == 1
        assert pool.put_many({key: tensor_for(key)}) == 0
        assert pool.stats()["put_skipped"] == 1


def test_longest_prefix_counts_chunks_with_every_layer_group():
    groups = [(0, 1), (1, 2)]
    tokens = list(range(100, 100 + 16 * 5 + 7))                     # five full chunks and a partial tail
    keys = chunks.chunk_keys(tokens, FP, 16, groups)
    with KVPool.memory("4M", chunk_tokens=16) as pool:
        assert pool.chunk_tokens == 16
        pool.put_many({k: tensor_for(k) for row in keys[:3] for k in row})
        pool.put_many({keys[3][0]: tensor_for(keys[3][0])})         # chunk 3 lacks group 1
        pool.put_many({k: tensor_for(k) for k in keys[4]})
        assert pool.longest_prefix(tokens, FP, groups) == 48
        assert pool.longest_prefix(tokens, FP, groups[:1]) == 80
        assert pool.longest_prefix(tokens[:40], FP, groups) == 32
        assert pool.longest_prefix(tokens, "f" * 32, groups) == 0   # another model's fingerprint
        with pytest.raises(ValueError):
            pool.longest_prefix(tokens, FP)


def test_longest_prefix_digests_are_exactly_record_keys():
    tokens = list(range(64))
    for kind in ("kv", "act"):
        for groups in ([(0, 3)], [(0, 1), (1, 300)]):
            keys = chunks.chunk_keys(tokens, FP, 16, groups, kind)
            with KVPool.memory("1M", chunk_tokens=16) as pool:
                pool.put_many({k: tensor_for(k) for row in keys for k in row})
                assert pool.longest_prefix(tokens, FP, groups, kind) == 64


def test_read_bandwidth_follows_the_throttle_split_by_ratio():
    with KVPool.memory("4M", devices=4, bandwidth=400e6) as pool:
        assert pool.read_bandwidth == pytest.approx(400e6, rel=1e-6)
        caps = [d["throttle"] for d in pool.stats()["devices"]]
        assert sum(caps) == pytest.approx(400e6) and all(c > 0 for c in caps)
        pool.set_throttle(None)
        assert pool.read_bandwidth > 400e6


def test_stats_describe_every_device():
    with KVPool.memory("4M", devices=2) as pool:
        keys = context_keys(8)
        pool.put_many({k: tensor_for(k) for k in keys})
        st = pool.stats()
        assert st["records"] == 8 and len(st["devices"]) == 2
        assert sum(d["records"] for d in st["devices"]) == 8
        assert sum(d["p"] for d in st["devices"]) == pytest.approx(1)
        assert {"kind", "capacity", "used", "free", "read_bw", "evictions"} <= set(st["devices"][0])


@pytest.mark.parametrize("kind", ["memory", "extent", "files"])
def test_a_persistent_pool_reopens_with_everything_acknowledged(tmp_path, kind):
    cfg = {"index_dir": str(tmp_path / "idx"), "probe_bytes": 1 << 20, "devices": [device_cfg(tmp_path, kind)]}
    keys = context_keys(10)
    with KVPool.open(cfg) as pool:
        pool.put_many({k: tensor_for(k) for k in keys})
    with KVPool.open(cfg) as pool:
        got = pool.get_many(keys)
        assert all(torch.equal(got[k], tensor_for(k)) for k in keys)
        assert pool.fsck() == {**pool.fsck(), "bad": [], "overlaps": 0, "checked": 10}


def test_yaml_file_with_env_override_and_relative_paths(tmp_path, monkeypatch):
    (tmp_path / "pool.yaml").write_text(textwrap.dedent("""
        pool:
          index_dir: idx
          durability: strict
          probe_bytes: 1M
          devices:
            - {type: files, path: kvfiles, capacity: 4M, bandwidth: 500M}
        """))
    monkeypatch.setenv("KVFLOW_POOL_DURABILITY", "relaxed")
    cfg = PoolConfig.load(tmp_path / "pool.yaml")
    assert cfg.durability == "relaxed" and cfg.devices[0].bandwidth == 500 << 20
    assert cfg.devices[0].path == str(tmp_path / "kvfiles") and cfg.index_dir == str(tmp_path / "idx")
    with KVPool.open(tmp_path / "pool.yaml") as pool:
        assert pool.read_bandwidth == 500 << 20


@pytest.mark.parametrize("bad, message", [
    ({"devices": []}, "at least one device"),
    ({"devices": [{"type": "tape", "capacity": 1}]}, "unknown device type 'tape'"),
    ({"devices": [{"type": "extent"}]}, r"pool.devices\[0\].path: required"),
    ({"devices": [{"type": "memory", "capacity": "lots"}]}, "expected int"),
    ({"devices": [{"type": "files", "path": "x", "capacity": "1M"}]}, "index_dir: required"),
    ({"durability": "sometimes", "devices": [{"type": "memory", "capacity": "1M"}]}, "strict or relaxed"),
    ({"devices": [{"type": "memory", "capacity": 1000}]}, "capacity: must be at least 4K"),
    ({"wal_compact_bytes": -1, "devices": [{"type": "memory", "capacity": "1M"}]}, "wal_compact_bytes: must be 0"),
    ({"index_dir": "", "devices": [{"type": "files", "path": "x", "capacity": "1M"}]}, "names no folder"),
    ({"index_dir": ".", "devices": [{"type": "files", "path": "x", "capacity": "1M"}]}, "names no folder"),
    ({"devices": [{"type": "memory", "capacity": 1, "colour": "red"}]}, "unknown key 'colour'"),
])
def test_an_invalid_config_is_one_clear_error(bad, message):
    with pytest.raises(ConfigError, match=message) as err:
        KVPool.open(bad)
    assert "\n" not in str(err.value)


def test_a_read_only_opener_in_another_process_sees_the_stored_records(tmp_path):
    cfg = {"index_dir": str(tmp_path / "idx"), "probe_bytes": 1 << 20,
           "devices": [device_cfg(tmp_path, "memory", path=str(tmp_path / "shm0")), device_cfg(tmp_path, "extent")]}
    keys = context_keys(12)
    with KVPool.open(cfg) as pool:                                   # the writer stays open meanwhile
        pool.put_many({k: tensor_for(k) for k in keys})
        script = textwrap.dedent(f"""
            import sys, torch
            sys.path.insert(0, {str(tmp_path.parent)!r})
            from kvflow.pool import KVPool
            from tests.pool.helpers import context_keys, tensor_for
            keys = context_keys(12)
            with KVPool.open({cfg!r}, readonly=True) as pool:
                got = pool.get_many(keys)
                assert all(torch.equal(got[k], tensor_for(k)) for k in keys), "wrong data"
                try:
                    pool.put_many({{keys[0]: tensor_for(keys[0])}})
                except Exception as err:
                    print("refused:", err)
            """)
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                             cwd=str(__import__("pathlib").Path(__file__).parents[2]))
        assert run.returncode == 0, run.stderr
        assert "refused: this pool is open read-only" in run.stdout


def test_a_second_writer_is_refused_with_a_clear_error(tmp_path):
    cfg = {"index_dir": str(tmp_path / "idx"), "devices": [device_cfg(tmp_path, "files", bandwidth=1 << 30)]}
    with KVPool.open(cfg):
        with pytest.raises(KVFlowError, match="readonly=True"):
            KVPool.open(cfg)


def test_a_closed_pool_refuses_work():
    pool = KVPool.memory("1M")
    pool.close()
    with pytest.raises(KVFlowError, match="closed"):
        pool.get_many(context_keys(1))


def test_bad_input_to_put_is_one_clear_error_and_leaks_nothing():
    from kvflow.errors import RecordError
    key = context_keys(1)[0]
    with KVPool.memory("1M") as pool:
        with pytest.raises(RecordError, match="at most 6"):
            pool.put_many({key: torch.zeros([1] * 7)})
        with pytest.raises(RecordError, match="unsupported storage dtype"):
            pool.put_many({key: torch.zeros(4)}, dtype=torch.int8)
        assert pool.stats()["used"] == 0
