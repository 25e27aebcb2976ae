"""The throttle, on a fake clock (no test here reads the wall clock): n bytes through a device capped at b bytes/s
take n/b seconds, concurrent requests share b, the burst is a few milliseconds, every read pays the link's latency
once and reads in flight together overlap theirs; the pool exposes the latency and validates it."""

import threading

import pytest

from kvflow.errors import ConfigError
from kvflow.pool import KVPool
from kvflow.pool.config import DeviceConfig
from kvflow.pool.devices import Throttled, open_device
from kvflow.pool.devices.throttle import BURST_S

from .helpers import context_keys, tensor_for


class FakeClock:
    """``advance``: sleeping moves time on (one caller after another). Otherwise time stands still and every sleep
    is only recorded — requests issued at the same instant, i.e. all in flight at once."""

    def __init__(self, advance: bool):
        self.now, self.advance, self.sleeps = 1000.0, advance, []
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps.append(seconds)
            if self.advance:
                self.now += seconds


def throttled(rate=None, latency=0.0, advance=True):
    clock = FakeClock(advance)
    dev = Throttled(open_device(DeviceConfig(type="memory", capacity=1 << 20)), rate, latency,
                    clock=clock, sleep=clock.sleep)
    return dev, clock


def test_a_capped_device_moves_n_bytes_in_n_over_b_seconds_less_one_burst():
    dev, clock = throttled(rate=20e6)
    t0 = clock.now
    for _ in range(40):
        dev.read(0, 65536)
    assert clock.now - t0 == pytest.approx(40 * 65536 / 20e6 - BURST_S)


def test_concurrent_readers_share_the_cap():
    dev, clock = throttled(rate=20e6, advance=False)
    threads = [threading.Thread(target=lambda: [dev.read(0, 65536) for _ in range(10)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(clock.sleeps) == pytest.approx(40 * 65536 / 20e6 - BURST_S)     # the last one waits for all 40


def test_rate_none_passes_straight_through_and_can_change_live():
    dev, clock = throttled()
    dev.read(0, 65536)
    assert clock.sleeps == []
    dev.set_rate(10e6)
    t0 = clock.now
    for _ in range(10):
        dev.read(0, 65536)
    assert clock.now - t0 == pytest.approx(10 * 65536 / 10e6 - BURST_S)


def test_every_read_pays_the_latency_once_and_writes_do_not():
    dev, clock = throttled(latency=1e-3)
    for _ in range(5):
        dev.read(0, 4096)
    dev.commit(0, dev.staging(0, 4096))
    assert clock.sleeps == pytest.approx([1e-3] * 5)


def test_a_lone_read_pays_latency_plus_bytes_over_bandwidth_and_so_does_each_read_of_a_loop():
    dev, clock = throttled(rate=1e6, latency=1e-3)
    for _ in range(3):
        dev.read(0, 4096)
    assert clock.sleeps == pytest.approx([1e-3 + 4096 / 1e6] * 3)


def test_reads_in_flight_together_overlap_their_latency_like_a_queue():
    dev, clock = throttled(rate=100e6, latency=1e-3, advance=False)
    threads = [threading.Thread(target=dev.read, args=(0, 65536)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(clock.sleeps) == pytest.approx([1e-3 + k * 65536 / 100e6 for k in range(1, 9)])  # one L each,
                                                                                                  # side by side


def test_the_pool_reports_the_read_latency_it_applies():
    keys = context_keys(4)
    with KVPool.memory("4M", devices=2, bandwidth=1e9) as pool:
        assert pool.read_latency == 0.0
        pool.set_throttle(1e9, latency_s=1e-4)
        assert pool.read_latency == pytest.approx(1e-4)
        assert [d["latency_s"] for d in pool.stats()["devices"]] == pytest.approx([1e-4, 1e-4])
        pool.put_many({k: tensor_for(k) for k in keys})
        assert all(v is not None for v in pool.get_many(keys).values())
        pool.set_throttle(None)
        assert pool.read_latency == 0.0


def test_a_configured_device_latency_adds_to_the_links():
    cfg = {"devices": [{"type": "memory", "capacity": "1M", "bandwidth": "1G", "latency_s": 2e-4},
                       {"type": "memory", "capacity": "1M", "bandwidth": "1G"}]}
    with KVPool.open(cfg) as pool:
        assert pool.read_latency == pytest.approx(2e-4)
        pool.set_throttle(1e9, latency_s=1e-4)
        assert [d["latency_s"] for d in pool.stats()["devices"]] == pytest.approx([3e-4, 1e-4])


@pytest.mark.parametrize("bad", [-1e-3, float("inf"), float("nan"), 60.0])
def test_a_bad_latency_is_one_clear_error(bad):
    with pytest.raises(ConfigError, match=r"devices\[0\]\.latency_s"):
        KVPool.open({"devices": [{"type": "memory", "capacity": "1M", "latency_s": bad}]})
    with KVPool.memory("1M") as pool, pytest.raises(ValueError, match="latency_s"):
        pool.set_throttle(1e9, latency_s=bad)
