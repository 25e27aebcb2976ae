"""Two readers and a writer at once: every record served is the one that was put, eviction under concurrent reads
never hands a reader someone else's bytes, and counters add up. Also a read-only process beside the writer."""

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import torch

from kvflow.pool import KVPool

from .helpers import context_keys, device_cfg, tensor_for


def hammer(pool, keys, seconds=1.5):
    errors, served = [], [0, 0]
    stop = threading.Event()

    def writer():
        for i in range(0, len(keys), 4):
            if stop.is_set():
                return
            pool.put_many({k: tensor_for(k) for k in keys[i:i + 4]})

    def reader(r):
        import random
        rng = random.Random(r)
        while not stop.is_set():
            batch = rng.sample(keys, 16)
            for k, v in pool.get_many(batch).items():
                if v is not None:
                    served[r] += 1
                    if not torch.equal(v, tensor_for(k)):
                        errors.append(k)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    threads[0].join()
    stop.wait(seconds / 3)
    stop.set()
    for t in threads[1:]:
        t.join()
    return errors, served


def test_two_readers_and_a_writer_on_a_pool_that_keeps_evicting():
    keys = context_keys(400)
    with KVPool.memory(48 * 4096, devices=2, chunk_tokens=16) as pool:   # room for ~1/10 of the keys
        errors, served = hammer(pool, keys)
        st = pool.stats()
    assert not errors and all(served), served
    assert st["evictions"] > 0 and st["corrupt"] == 0
    assert st["hits"] == sum(served)


def test_concurrent_access_on_disk_devices(tmp_path):
    keys = context_keys(200)
    cfg = {"index_dir": str(tmp_path / "idx"), "durability": "relaxed", "checkpoint_interval_s": 0.05,
           "devices": [device_cfg(tmp_path, "extent", capacity=40 * 4096, bandwidth=1 << 30),
                       device_cfg(tmp_path, "files", capacity=40 * 4096, bandwidth=1 << 30)]}
    with KVPool.open(cfg) as pool:
        errors, served = hammer(pool, keys)
        assert not errors and all(served)
        assert pool.fsck()["bad"] == []


def test_a_read_only_process_reads_while_the_writer_keeps_writing(tmp_path):
    keys = context_keys(300)
    cfg = {"index_dir": str(tmp_path / "idx"), "devices": [device_cfg(tmp_path, "memory", capacity=160 * 4096,
                                                                       bandwidth=1 << 30)]}
    script = textwrap.dedent(f"""
        import torch
        from kvflow.pool import KVPool
        from tests.pool.helpers import context_keys, tensor_for
        keys = context_keys(300)
        served = 0
        with KVPool.open({cfg!r}, readonly=True) as pool:
            for _ in range(20):
                pool.refresh()
                for k, v in pool.get_many(keys).items():
                    if v is not None:
                        served += 1
                        assert torch.equal(v, tensor_for(k)), "served a wrong record"
        print("served", served)
        """)
    with KVPool.open(cfg) as pool:
        pool.put_many({k: tensor_for(k) for k in keys[:40]})
        reader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                  stderr=open(tmp_path / "reader.err", "w"), text=True,
                                  cwd=str(Path(__file__).parents[2]))
        i = 40
        while reader.poll() is None:
            pool.put_many({k: tensor_for(k) for k in keys[i % 300:i % 300 + 4]})
            i += 4
            time.sleep(0.002)
        out, _ = reader.communicate()
    assert reader.returncode == 0, (tmp_path / "reader.err").read_text()[-2000:]
    assert int(out.split()[-1]) > 0
