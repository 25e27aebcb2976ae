"""Bandwidth-aware striping: device i gets p_i = b_i / sum(b) of the bytes of *every* run of consecutive records,
so reading any suffix of a context keeps all devices busy; full devices spill to others before anything is
evicted; the baselines (equal, overflow) are the same machinery with other weights."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.pool import KVPool
from kvflow.pool.striping import Striper, make_placement

from .helpers import context_keys, tensor_for


def place(striper, sizes):
    out = []
    for n in sizes:
        dev = striper.order(n)[0]
        striper.charge(dev, n)
        out.append(dev)
    return out


@settings(max_examples=150, deadline=None)
@given(weights=st.lists(st.integers(1, 8), min_size=1, max_size=5),
       sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=300), lo=st.floats(0, 1), hi=st.floats(0, 1))
def test_any_run_of_records_is_split_by_bandwidth_within_two_records(weights, sizes, lo, hi):
    devs = place(Striper(weights), sizes)
    a, b = sorted((int(lo * len(sizes)), int(hi * len(sizes))))
    total = sum(sizes[a:b])
    p = [w / sum(weights) for w in weights]
    for i in range(len(weights)):
        got = sum(n for n, d in zip(sizes[a:b], devs[a:b]) if d == i)
        assert abs(got - p[i] * total) <= 2 * max(sizes), (i, got, p[i] * total)


def test_equal_records_at_1_1_2_4_repeat_every_eight():
    devs = place(Striper([1, 1, 2, 4]), [100] * 64)
    for k in range(0, 64 - 8):
        window = devs[k:k + 8]
        assert [window.count(i) for i in range(4)] == [1, 1, 2, 4]


def test_striping_continues_across_puts_of_one_record():
    s = Striper([1, 3])
    assert place(s, [10] * 8).count(1) == place(s, [10] * 8).count(1) == 6


def test_baselines_are_other_weights_of_the_same_striper():
    assert place(make_placement("equal", [1, 9]), [1] * 10).count(0) == 5
    assert make_placement("overflow", [1, 9]).order(1) == [0, 1]


def bandwidth_pool(weights, capacity=4 << 20, **kw):
    return KVPool.open({"devices": [{"type": "memory", "capacity": capacity, "bandwidth": int(w * 1e8)}
                                    for w in weights], "chunk_tokens": 16, **kw})


def test_a_context_and_its_suffix_use_every_device_by_ratio():
    keys = context_keys(64)
    with bandwidth_pool([1, 1, 2, 4]) as pool:
        pool.put_many({k: tensor_for(k) for k in keys})
        dev_of = {d: e[1] for e in pool.entries() for d in [e[0]]}
        for suffix in (keys, keys[-16:], keys[-8:]):
            counts = [sum(dev_of[k.digest] == i for k in suffix) for i in range(4)]
            assert counts == [len(suffix) // 8 * w for w in (1, 1, 2, 4)]


def test_a_full_fast_device_spills_to_the_others_before_evicting():
    keys = context_keys(60)
    with bandwidth_pool([8, 1], capacity=64 * 4096) as pool:      # each record takes two 4 KiB units
        pool.put_many({k: tensor_for(k) for k in keys})
        st = pool.stats()
        assert st["evictions"] == 0 and st["records"] == 60
        assert st["devices"][0]["used"] <= 0.95 * st["devices"][0]["capacity"]


def test_overflow_placement_fills_one_device_at_a_time():
    keys = context_keys(20)
    with bandwidth_pool([1, 1], capacity=64 * 4096, placement="overflow") as pool:
        pool.put_many({k: tensor_for(k) for k in keys})
        assert [d["records"] for d in pool.stats()["devices"]] == [20, 0]


@pytest.mark.parametrize("placement, expect", [("equal", [8, 8, 8, 8]), ("bandwidth", [4, 4, 8, 16])])
def test_placement_policy_is_a_config_value(placement, expect):
    with bandwidth_pool([1, 1, 2, 4], placement=placement) as pool:
        pool.put_many({k: tensor_for(k) for k in context_keys(32)})
        assert [d["records"] for d in pool.stats()["devices"]] == expect


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.integers(1, 4), min_size=2, max_size=4), layers=st.integers(1, 12),
       chunks=st.integers(4, 40))
def test_records_spread_over_devices_along_layers_and_along_chunks(weights, layers, chunks):
    """Records put chunk by chunk, one per layer (the restorer's layout): the chunks of any one layer — what a
    layer-by-layer load reads — split by p_i like any run; so does the whole set."""
    s = Striper(weights)
    dev = {}
    for i in range(chunks):
        for layer in range(layers):
            dev[i, layer] = d = s.order(100, lane=layer)[0]
            s.charge(d, 100, lane=layer)
    p = [w / sum(weights) for w in weights]
    for layer in range(layers):
        for k in range(len(weights)):
            got = sum(dev[i, layer] == k for i in range(chunks))
            assert abs(got - p[k] * chunks) <= 2, (layer, k, got)


def test_equal_devices_form_a_latin_square():
    s = Striper([1, 1])
    rows = []
    for i in range(6):
        row = []
        for layer in range(4):
            d = s.order(10, lane=layer)[0]
            s.charge(d, 10, lane=layer)
            row.append(d)
        rows.append(row)
    assert all(sorted(r) == [0, 0, 1, 1] for r in rows), rows        # each chunk's 4 layers: 2 and 2
    assert all(rows[i][j] != rows[i + 1][j] for i in range(5) for j in range(4)), rows   # each layer alternates


def test_token_bucket_caps_from_the_weights_keep_every_device_busy_equally_long():
    """The bench's token-bucket section by arithmetic: with caps split by p_i, each device's share of a striped
    context takes it the same time to read (bytes_i / cap_i), so the striped read is the sum of the caps."""
    weights = (4, 2, 1, 1)
    cfg = {"devices": [{"type": "memory", "capacity": "16M", "bandwidth": int(w * 1e8)} for w in weights]}
    keys = context_keys(96)
    with KVPool.open(cfg) as pool:
        pool.set_throttle(8e8)
        pool.put_many({k: tensor_for(k, numel=16384) for k in keys})
        caps = [d["throttle"] for d in pool.stats()["devices"]]
        per_dev = [sum(n for _, dev, _, n, _ in pool.entries() if dev == i) for i in range(len(weights))]
    assert caps == pytest.approx([w * 1e8 for w in weights])
    busy = [b / c for b, c in zip(per_dev, caps)]
    record = sum(per_dev) / len(keys)                            # every record has the same size
    assert max(busy) - min(busy) <= record / min(caps)         # within one record of the slowest device
    assert sum(per_dev) / max(busy) >= 0.9 * sum(caps)         # the striped read reaches the sum of the caps
