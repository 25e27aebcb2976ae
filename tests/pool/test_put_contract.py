"""What put_many promises its caller: keys are ChunkKeys (anything else is one clear TypeError), and in strict mode
the call returns only after the data device and the log were synced — proven by recording every write and sync
the pool makes, not by timing."""

import os
import time

import pytest

from kvflow.pool import KVPool

from .helpers import context_keys, device_cfg, tensor_for


def test_a_str_key_is_one_type_error_that_names_chunk_key():
    with KVPool.memory("1M") as pool:
        for call in (lambda: pool.put_many({"k": tensor_for(context_keys(1)[0])}),
                     lambda: pool.get_many(["k"]), lambda: pool.contains([b"k"])):
            with pytest.raises(TypeError, match=r"ChunkKey.*chunk_keys\("):
                call()
        key = context_keys(1)[0]
        with pytest.raises(TypeError, match="not a torch.Tensor"):
            pool.put_many({key: [1.0, 2.0]})
        assert pool.stats()["records"] == 0


def _record_io(monkeypatch) -> list[tuple[str, str]]:
    """Every os.pwritev / os.write / os.fsync / os.fdatasync from now on, as (call, file name), in call order."""
    events: list[tuple[str, str]] = []

    def name_of(fd: int) -> str:
        try:
            return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return "?"

    for call in ("pwritev", "write", "fsync", "fdatasync"):
        real = getattr(os, call)

        def recorded(fd, *args, _real=real, _call=call):
            events.append((_call, name_of(fd)))
            return _real(fd, *args)
        monkeypatch.setattr(os, call, recorded)
    return events


def _last(events, calls, file_match) -> int:
    return max((i for i, (c, f) in enumerate(events) if c in calls and file_match(f)), default=-1)


@pytest.mark.parametrize("durability", ["strict", "relaxed"])
def test_a_strict_put_returns_only_after_the_data_device_and_then_the_log_were_synced(tmp_path, monkeypatch,
                                                                                     durability):
    cfg = {"index_dir": str(tmp_path / "idx"), "durability": durability, "checkpoint_interval_s": 3600,
           "devices": [device_cfg(tmp_path, "extent", bandwidth=1 << 30)]}
    keys = context_keys(6)
    with KVPool.open(cfg) as pool:
        events = _record_io(monkeypatch)
        assert pool.put_many({k: tensor_for(k) for k in keys}) == len(keys)
        returned = list(events)                       # what had happened when put_many returned
        monkeypatch.undo()
    is_data, is_log = (lambda f: f == "disk.img"), (lambda f: f.startswith("wal."))
    data_written = _last(returned, ("pwritev",), is_data)
    data_synced = _last(returned, ("fsync", "fdatasync"), is_data)
    log_written = _last(returned, ("write",), is_log)
    log_synced = _last(returned, ("fsync", "fdatasync"), is_log)
    assert data_written >= 0 and log_written >= 0, returned       # the recorder sees the pool's I/O
    if durability == "strict":
        assert data_written < data_synced < log_written < log_synced, returned
    else:                                         # relaxed: the periodic checkpoint syncs, the put does not
        assert data_synced == -1 and log_synced == -1, returned


def test_a_relaxed_put_acknowledged_before_synced_at_has_its_data_and_its_log_entry_synced(tmp_path, monkeypatch):
    """``synced_at`` is when the last completed sync pass began: once it passes a put's acknowledgement, that
    put's record and its log entry were both synced after they were written (what a power cut then keeps)."""
    cfg = {"index_dir": str(tmp_path / "idx"), "durability": "relaxed", "checkpoint_interval_s": 0.05,
           "devices": [device_cfg(tmp_path, "extent", bandwidth=1 << 30)]}
    keys = context_keys(4)
    with KVPool.open(cfg) as pool:
        assert pool.synced_at > 0, "the checkpoint at open is a completed pass"
        events = _record_io(monkeypatch)
        assert pool.put_many({k: tensor_for(k) for k in keys}) == len(keys)
        acked, put_end = time.time(), len(events)
        deadline = time.monotonic() + 60
        while pool.synced_at <= acked and time.monotonic() < deadline:
            time.sleep(0.01)
        seen = list(events)
        monkeypatch.undo()
        assert pool.synced_at > acked, "the background pass never completed"
        assert pool.stats()["sync_passes"] >= 2
    is_data, is_log = (lambda f: f == "disk.img"), (lambda f: f.startswith("wal."))
    assert _last(seen[:put_end], ("pwritev",), is_data) >= 0 and _last(seen[:put_end], ("write",), is_log) >= 0
    after = seen[put_end:]
    assert _last(after, ("fsync", "fdatasync"), is_data) >= 0, seen
    assert _last(after, ("fsync", "fdatasync"), is_log) >= 0, seen
