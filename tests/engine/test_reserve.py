"""The activation reserve is measured (positive, grows with the token budget) where the engine holds its budget and
estimated otherwise; an auto KV budget follows free memory; the start-up budget adds up."""

import logging
import subprocess
import sys

import pytest
import torch

from kvflow.engine import EngineConfig, LLMEngine
from kvflow.engine.paged_cache import PagedKVCache
from kvflow.errors import ConfigError
from kvflow.engine.reserve import MemoryBudget, estimated_reserve, measure_activation_reserve, weight_bytes


def test_reserve_is_positive_and_grows_with_the_token_budget(tiny):
    small, large = (measure_activation_reserve(tiny, n) for n in (64, 1024))
    assert 0 < small < large
    assert large >= 4 * small                  # 16x the tokens: activations scale with tokens, not a fixed cost


def test_reserve_is_cached_per_model_and_budget(tiny):
    first = measure_activation_reserve(tiny, 128)
    assert measure_activation_reserve(tiny, 128) == first


def test_a_budget_longer_than_the_context_is_packed_as_several_sequences(tiny):
    assert measure_activation_reserve(tiny, 256, max_model_len=100) > 0


def test_the_probe_puts_the_budgets_tokens_at_the_end_of_the_longest_sequence(tiny, monkeypatch):
    """They attend to all of it: the probe's steps include a chunk of the budget's tokens ending at the longest
    sequence. (It used to compare the reserves at 128 and 4,096 keys; with the native chunk op a short prompt reads
    its keys in place, consecutive blocks are read as views on torch's path, and what is left of the difference is
    under the heap's noise: 6.8 against 4.6 MB alone in a process, either order in a full run.)"""
    from kvflow.engine import reserve
    ends, spans = [], reserve._spans
    monkeypatch.setattr(reserve, "_spans", lambda *a, **k: ends.append(max(e for _, e in spans(*a, **k))) or
                        spans(*a, **k))
    measure_activation_reserve(tiny, 120, max_model_len=4000)          # a budget no other test caches
    assert 4000 in ends and all(e <= 4000 for e in ends)


@pytest.mark.parametrize("probe_slope", [100, 2000])     # bytes per key the probe steps show: below / above the floor
def test_beyond_the_probed_context_the_reserve_grows_at_least_by_the_gathered_kv(tiny, monkeypatch, probe_slope):
    """Past PROBE_CONTEXT the reserve is extended along the line through two probes, never below the K/V bytes one
    more key gathers. (The probe's peaks are made deterministic here: two real peaks differ by a few MiB of heap
    growth now and then, more than the slope over a 32K-key stretch on tiny.)"""
    from kvflow.engine import reserve
    from kvflow.engine.reserve import PROBE_CONTEXT
    monkeypatch.setattr(reserve, "_CACHE", {})
    monkeypatch.setattr(reserve, "_window", lambda runner, tokens, seq_len, *a, **k: 10_000 + probe_slope * seq_len)
    at = measure_activation_reserve(tiny, 64, max_model_len=PROBE_CONTEXT)
    far = measure_activation_reserve(tiny, 64, max_model_len=4 * PROBE_CONTEXT)
    per_key = 2 * tiny.kv_heads * tiny.head_dim * 4
    assert at == 10_000 + probe_slope * PROBE_CONTEXT
    assert far - at == max(probe_slope, per_key) * 3 * PROBE_CONTEXT


def test_the_probe_measures_a_real_step_beyond_the_probed_context_too(tiny):
    """The same two calls on the real probe: positive, and the far one no smaller."""
    from kvflow.engine.reserve import PROBE_CONTEXT
    at = measure_activation_reserve(tiny, 64, max_model_len=PROBE_CONTEXT)
    assert measure_activation_reserve(tiny, 64, max_model_len=4 * PROBE_CONTEXT) > at > 0


def test_the_probe_step_samples_as_many_sequences_as_a_step_may(tiny, monkeypatch):
    """Every sequence of a step is sampled, so the probe's step holds ``max_num_seqs`` sequences (one long chunk at
    the end of the longest sequence, the rest one token each) within the budget: their fp32 logits count (a few
    hundred KiB on tiny's 1K vocabulary, tens of MiB on a 150K one)."""
    from kvflow.engine import reserve
    from kvflow.engine.model_runner import BatchRunner

    seen = []
    original = BatchRunner.execute

    def execute(self, items):
        seen.append((sum(len(i.token_ids) for i in items), sum(i.sample for i in items), max(i.start for i in items)))
        return original(self, items)

    monkeypatch.setattr(BatchRunner, "execute", execute)
    monkeypatch.setattr(reserve, "_CACHE", {})
    measure_activation_reserve(tiny, 512, max_model_len=2048, max_num_seqs=64)
    assert (512, 64, 2048 - (512 - 63)) in seen


def test_weights_count_tied_parameters_once(tiny):
    params = sum(p.numel() * p.element_size() for p in tiny.hf_model.parameters())
    assert params <= weight_bytes(tiny) <= params + 2**20


def test_startup_report_adds_up(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="kvflow.engine"):
        engine = LLMEngine(tiny, EngineConfig(kv_budget=4 * 2**20, max_num_batched_tokens=256))
    m = engine.memory
    per_block = 16 * tiny.shape.kv_bytes_per_token("float32")
    assert m.kv_blocks == engine.num_blocks * per_block == engine.cache.kv.numel() * 4
    longest = min(engine.max_model_len, engine.num_blocks * 16)
    assert m.activation_reserve == estimated_reserve(tiny, 256, max_model_len=longest,
                                                     max_num_seqs=engine.config.max_num_seqs)
    assert m.weights == weight_bytes(tiny)
    assert m.total == m.weights + m.activation_reserve + m.kv_blocks
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory:"))
    assert "weights" in line and "activation reserve" in line and "KV blocks" in line and line.endswith("MiB")


def test_a_stated_reserve_is_not_measured(tiny):
    cfg = EngineConfig(kv_budget=2**20, activation_reserve="3M")
    cfg.validate()
    assert LLMEngine(tiny, cfg).memory.activation_reserve == 3 * 2**20


def test_elastic_blocks_are_shown_inside_the_reserve_not_added():
    m = MemoryBudget(weights=100, activation_reserve=64, kv_blocks=320, num_blocks=10, block_size=16,
                     elastic_blocks=2)
    assert m.block_bytes == 32 and m.total == 100 + 64 + 320
    assert "lends 2 elastic blocks" in m.line()


def test_where_nothing_can_be_measured_the_shape_formula_stands_in(tiny, monkeypatch, caplog):
    from kvflow.engine import reserve

    def refuse(self):
        raise OSError("no /proc/self/clear_refs")

    monkeypatch.setattr(reserve._HostPeak, "start", refuse)
    monkeypatch.setattr(reserve, "_CACHE", {})
    with caplog.at_level(logging.WARNING, logger="kvflow.engine"):
        got = measure_activation_reserve(tiny, 96)
    assert got == reserve.formula_reserve(tiny, 96) > 0
    assert any("not measurable" in r.getMessage() for r in caplog.records)


def test_an_elastic_engine_reports_the_blocks_its_reserve_lends(tiny):
    m = LLMEngine(tiny, EngineConfig(kv_budget=2**20, elastic_reserve=True)).memory
    assert 0 < m.elastic_blocks * m.block_bytes <= m.activation_reserve
    assert m.total == m.weights + m.activation_reserve + m.kv_blocks and "elastic blocks" in m.line()


def test_the_probe_window_runs_a_fresh_prefill_a_chunk_half_way_and_one_at_the_end(tiny, monkeypatch):
    """One window: the budget's tokens as a prompt's first chunk (from position 0), as a chunk ending half-way to the
    longest sequence and at its end, each followed by a step of one-token decodes — back to back, as a run meets
    them, so the heap the steps leave each other is measured too."""
    from kvflow.engine import reserve
    from kvflow.engine.model_runner import BatchRunner

    seen = []
    original = BatchRunner.execute

    def execute(self, items):
        seen.append([(i.start, len(i.token_ids)) for i in items if len(i.token_ids) > 1])
        return original(self, items)

    monkeypatch.setattr(BatchRunner, "execute", execute)
    reserve._window(tiny, 256, 2048, tiny.hf_model.device, None, 4)
    assert seen == [[(0, 253)], [], [(1152 - 253, 253)], [], [(2048 - 253, 253)], []]
    seen.clear()                    # a budget longer than the sequence: the three shapes are one, run once
    reserve._window(tiny, 256, 100, tiny.hf_model.device, None, 4)
    assert seen == [[(0, 100), (0, 100), (0, 53)], []]


def test_the_reserve_is_the_highest_window_plus_the_spread_of_the_windows(tiny, monkeypatch):
    """Identical windows read differently (the heap's state); the reserve adds their spread to the highest read."""
    from kvflow.engine import reserve
    reads = iter([100, 130, 90])
    monkeypatch.setattr(reserve, "_CACHE", {})
    monkeypatch.setattr(reserve, "_window", lambda runner, tokens, seq_len, device, probe, *a, **k:
                        0 if probe is None else next(reads))             # None: the warm-up step
    assert measure_activation_reserve(tiny, 64, max_model_len=64) == 130 + (130 - 90)


@pytest.mark.parametrize("elastic,release,released", [(False, False, False), (False, True, True), (True, False, True)])
def test_a_large_step_hands_freed_heap_back_where_the_budget_must_hold(tiny, monkeypatch, elastic, release, released):
    """engine.release_heap (on with the elastic reserve) trims the heap after every step of >= TRIM_TOKENS tokens,
    so each starts from the heap the probe measured from; off, nothing is trimmed (a step's re-faulted pages cost)."""
    from kvflow.engine import engine as engine_mod
    from kvflow.engine.sampling import SamplingParams
    calls, held = [], []
    monkeypatch.setattr(engine_mod, "release_freed_memory", lambda: calls.append(1))
    monkeypatch.setattr(engine_mod, "hold_to_live_set", lambda: held.append(1))
    cfg = EngineConfig(kv_budget=2**22, max_num_batched_tokens=512, activation_reserve="8M", elastic_reserve=elastic,
                       release_heap=release)
    cfg.validate()
    engine = LLMEngine(tiny, cfg)
    engine.add_request(list(range(1, 400)), SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert bool(calls) == released
    assert bool(held) == released          # and the process's large allocations are mapped per use from start-up


def test_held_to_the_live_set_a_freed_large_tensor_leaves_resident_memory():
    """hold_to_live_set pins glibc's mmap threshold at 256 KiB: a tensor of a few MiB (below glibc's own 32 MiB
    ceiling, so the heap would keep it once a larger one was freed) is unmapped when freed, and resident memory
    falls by its size. In a fresh process (a heap with holes from earlier work would serve it from a hole)."""
    from kvflow.model import host_memory
    if host_memory._LIBC is None:
        pytest.skip("no glibc here")
    code = """if True:
        import torch
        from kvflow.engine import reserve
        from kvflow.model import host_memory
        rss = lambda: reserve._status_bytes("VmRSS:")
        big = torch.ones(24 * 2**20 // 4); del big          # glibc's threshold rises to 24 MiB: 8 MiB is heap now
        assert host_memory.hold_to_live_set() and host_memory.hold_to_live_set()
        t = torch.ones(8 * 2**20 // 4)
        with_it = rss()
        del t
        print(with_it - rss())
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) >= 0.9 * 8 * 2**20


def test_the_reserve_is_measured_again_in_the_other_heap_regime(tiny, monkeypatch):
    """A probe taken before the pin read another heap than the served steps will run on: the cache keys on it."""
    from kvflow.engine import reserve
    from kvflow.model import host_memory
    monkeypatch.setattr(reserve, "_CACHE", {})
    reads = iter([10, 10, 10, 20, 20, 20])
    monkeypatch.setattr(reserve, "_window", lambda runner, tokens, seq_len, device, probe, *a, **k:
                        0 if probe is None else next(reads))
    monkeypatch.setattr(host_memory, "_in_force", host_memory.KEEP)
    assert measure_activation_reserve(tiny, 64, max_model_len=64) == 10
    monkeypatch.setattr(host_memory, "_in_force", host_memory.LIVE_SET)
    assert measure_activation_reserve(tiny, 64, max_model_len=64) == 20


def test_an_auto_kv_budget_is_a_share_of_free_memory_capped_at_what_the_engine_can_fill(tiny):
    from kvflow.engine.reserve import auto_kv_budget
    cfg = EngineConfig(kv_budget="auto", max_num_seqs=4)
    cfg.validate()
    per_token = tiny.shape.kv_bytes_per_token("float32")
    share = auto_kv_budget(tiny, cfg, 4096, reserve=2**20, available=64 * 2**20 + 2**20)
    assert share.why == "share" and share.budget == 16 * 2**20 and "available" in share.line()
    capped = auto_kv_budget(tiny, cfg, 1024, reserve=0, available=2**40)
    assert capped.why == "cap" and capped.budget == 1024 * 4 * per_token
    one = auto_kv_budget(tiny, cfg, 8192, reserve=0, available=40 * 2**20)      # a share below one 8K sequence
    assert one.why == "one sequence" and one.budget == 8192 * per_token
    with pytest.raises(ConfigError):
        auto_kv_budget(tiny, cfg, 1024, reserve=2**20, available=2**20)


def test_an_engine_with_an_auto_budget_sizes_its_blocks_from_free_memory(tiny, monkeypatch):
    import kvflow.model.runner
    monkeypatch.setattr(kvflow.model.runner, "free_memory", lambda device: 64 * 2**20)
    cfg = EngineConfig(kv_budget="auto", max_model_len=4096)
    cfg.validate()
    engine = LLMEngine(tiny, cfg)
    assert engine.kv_sizing is not None and engine.num_blocks * 16 * tiny.kv_bytes_per_token() <= 16 * 2**20


@pytest.mark.parametrize("value", ["lots", "-5M", 0, "auto!"])
def test_a_kv_budget_is_a_size_or_auto_else_one_config_error(value):
    with pytest.raises(ConfigError, match="kv_budget"):
        EngineConfig.load({"engine": {"kv_budget": value}})
    assert EngineConfig.load({"engine": {"kv_budget": " Auto "}}).auto_kv_budget


def test_the_default_reserve_is_estimated_from_the_shape_and_a_stated_one_is_kept(tiny):
    from kvflow.engine.reserve import engine_reserve
    plain = EngineConfig(max_num_batched_tokens=64)
    assert engine_reserve(tiny, plain, 1024) == (estimated_reserve(tiny, 64, max_model_len=1024,
                                                                   max_num_seqs=plain.max_num_seqs), "estimated")
    assert engine_reserve(tiny, EngineConfig(activation_reserve=5), 1024) == (5, "stated")
