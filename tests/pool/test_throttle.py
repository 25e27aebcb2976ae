"""The throttle: n bytes through a device capped at b bytes/s take at least n/b seconds, concurrent requests share
b, and the bucket's burst is only a few milliseconds."""

import threading
import time

from kvflow.pool.config import DeviceConfig
from kvflow.pool.devices import Throttled, open_device
from kvflow.pool.devices.throttle import BURST_S


def timed_reads(dev, n: int, size: int, threads: int) -> float:
    def work():
        for _ in range(n // threads):
            dev.read(0, size)
    ts = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.monotonic() - t0


def test_a_capped_device_moves_n_bytes_in_at_least_n_over_b_seconds():
    dev = Throttled(open_device(DeviceConfig(type="memory", capacity=1 << 20)), rate=20e6)
    moved = 40 * 65536
    took = timed_reads(dev, 40, 65536, threads=1)
    assert took >= moved / 20e6 - BURST_S
    assert took < moved / 20e6 * 2 + 0.2, "the cap, not much slower"


def test_concurrent_readers_share_the_cap():
    dev = Throttled(open_device(DeviceConfig(type="memory", capacity=1 << 20)), rate=20e6)
    moved = 40 * 65536
    took = timed_reads(dev, 40, 65536, threads=4)
    assert took >= moved / 20e6 - BURST_S


def test_rate_none_passes_straight_through_and_can_change_live():
    dev = Throttled(open_device(DeviceConfig(type="memory", capacity=1 << 20)))
    assert timed_reads(dev, 40, 65536, threads=1) < 0.5
    dev.set_rate(10e6)
    assert timed_reads(dev, 10, 65536, threads=1) >= 10 * 65536 / 10e6 - BURST_S
