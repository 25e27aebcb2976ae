"""The connector's two halves against a real kvflow pool, vLLM replaced by fakes (tests/integrations/fakes.py).

Scheduler side: the longest stored prefix in whole chunks, capped so one token is computed, beyond the local hit
(a prompt ending on a chunk: its last chunk loaded but for that token).
Worker side: loads verified records into exactly the blocks vLLM gave, reports a missing record's blocks,
saves the chunks that became full under kvflow's own keys (so kvflow serve finds them) and never saves a step
that ran on a failed load.
"""

import pytest
import torch

from kvflow.chunks.keys import chunk_keys, layer_groups
from kvflow.integrations.paged import PagedLayout, slot_mapping
from kvflow.integrations.vllm import ConnectorConfig, SchedulerSide, WorkerSide, layer_index
from tests.integrations.fakes import LosingPool, Request, kv_layer, memory_pool, write_op

FP = "ab" * 16
C, BS, L, H, D, NB = 64, 32, 3, 2, 8, 40


def store_context(pool, tokens, n_chunks):
    """Records as kvflow serve writes them (keys of kvflow.chunks, one per chunk x layer); returns them."""
    keys = chunk_keys(tokens[:n_chunks * C], FP, C, layer_groups(L, 1))
    records = {k: torch.randn(1, 2, H, C, D) for row in keys for k in row}
    pool.put_many(records)
    return keys, records


def sides(pool, transposed=True, cfg=None):
    cfg = cfg or ConnectorConfig()
    sched = SchedulerSide(cfg, pool.cfg, FP, L, BS, pool=pool)
    layout = PagedLayout.probed(write_op(transposed), H, BS, D, torch.float32)
    worker = WorkerSide(cfg, pool, BS, lambda layer: layout)
    worker.register({f"model.layers.{i}.self_attn.attn": kv_layer(NB, H, BS, D) for i in range(L)})
    return sched, worker, layout


def schedule(sched, req, blocks, computed, scheduled, local=0):
    """One vLLM admission + step: ask, allocate, build the step's metadata."""
    ext = sched.matched(req.request_id, req.all_token_ids, local)
    sched.allocated(req, ext)
    return ext, sched.build([(req.request_id, blocks, computed or local + ext)], [], {req.request_id: scheduled}, {})


def run_step(worker, meta):
    worker.start_load(meta)
    for name in worker.names:
        worker.wait_layer(name)
    worker.save(meta)
    worker.flush()


@pytest.fixture
def pool():
    p = memory_pool(C)
    yield p
    p.close()


def test_layer_names_map_to_layer_indices():
    assert layer_index("model.layers.12.self_attn.attn") == 12
    assert layer_index("transformer.h.3.attn.attn") == 3


@pytest.mark.parametrize("prompt_len,stored,local,expect", [
    (4 * C + 5, 4, 0, 4 * C),          # the whole stored prefix
    (4 * C, 4, 0, 4 * C - 1),          # prompt ends on a chunk: all but its last token, which vLLM computes
    (4 * C, 3, 0, 3 * C),              # ... only when that last chunk is stored
    (4 * C + 5, 2, 0, 2 * C),          # only what is stored
    (4 * C + 5, 4, 2 * C, 2 * C),      # beyond the local prefix-cache hit
    (4 * C + 5, 4, 3 * C + BS, C - BS),  # a local hit inside a chunk: the rest of that chunk and no more
    (4 * C + 5, 4, 4 * C, 0),          # nothing beyond the local hit
    (C - 1, 4, 0, 0),                  # shorter than a chunk
])
def test_the_match_is_the_stored_prefix_in_whole_chunks_beyond_the_local_hit(pool, prompt_len, stored, local, expect):
    tokens = list(range(1, 4 * C + 6))
    store_context(pool, tokens, stored)
    sched = SchedulerSide(ConnectorConfig(), pool.cfg, FP, L, BS, pool=pool)
    assert sched.matched("r", tokens[:prompt_len], local) == expect


def test_a_different_prompt_or_model_is_no_hit(pool):
    tokens = list(range(1, 3 * C + 6))
    store_context(pool, tokens, 3)
    sched = SchedulerSide(ConnectorConfig(), pool.cfg, FP, L, BS, pool=pool)
    assert sched.matched("a", [9] + tokens[1:], 0) == 0
    assert sched.matched("b", tokens[:C] + [0] + tokens[C + 1:], 0) == C
    other = SchedulerSide(ConnectorConfig(), pool.cfg, "cd" * 16, L, BS, pool=pool)
    assert other.matched("c", tokens, 0) == 0


def test_hits_below_min_tokens_and_loading_off_are_ignored(pool):
    tokens = list(range(1, 3 * C + 6))
    store_context(pool, tokens, 3)
    assert SchedulerSide(ConnectorConfig(min_tokens=4 * C), pool.cfg, FP, L, BS, pool=pool).matched("r", tokens, 0) == 0
    assert SchedulerSide(ConnectorConfig(load=False), pool.cfg, FP, L, BS, pool=pool).matched("r", tokens, 0) == 0


@pytest.mark.parametrize("transposed", [True, False])
def test_loaded_chunks_land_in_the_requests_blocks_exactly(pool, transposed):
    tokens = list(range(1, 3 * C + 6))
    keys, records = store_context(pool, tokens, 3)
    sched, worker, layout = sides(pool, transposed)
    blocks = [5, 17, 2, 30, 11, 8, 21]                   # 3 chunks = 6 blocks + the suffix's
    ext, meta = schedule(sched, Request("r", tokens), blocks, 0, len(tokens) - 3 * C)
    assert ext == 3 * C and len(meta.loads) == 1
    run_step(worker, meta)
    assert worker.load_errors() == set()
    for layer in range(L):
        k, v = layout.read(worker.caches[layer], blocks[:6])
        want = torch.cat([records[keys[i][layer]][0] for i in range(3)], dim=2)     # [2, H, 3C, D]
        assert torch.equal(k, want[0]) and torch.equal(v, want[1])
    assert torch.isnan(worker.caches[0][blocks[6]]).all()     # the suffix's block is vLLM's to compute


def test_a_prompt_ending_on_a_chunk_loads_its_last_chunk_but_for_the_token_vllm_computes(pool):
    tokens = list(range(1, 3 * C + 1))                   # 3 whole chunks, all stored
    keys, records = store_context(pool, tokens, 3)
    sched, worker, layout = sides(pool)
    blocks = [5, 17, 2, 30, 11, 8]
    ext, meta = schedule(sched, Request("r", tokens), blocks, 0, 1)
    assert ext == 3 * C - 1 and meta.loads[0].end == 3 * C - 1 and len(meta.loads[0].chunks) == 3
    run_step(worker, meta)
    assert worker.load_errors() == set()
    for layer in range(L):
        k, v = layout.read(worker.caches[layer], blocks)
        want = torch.cat([records[keys[i][layer]][0] for i in range(3)], dim=2)     # [2, H, 3C, D]
        assert torch.equal(k[:, :-1], want[0, :, :-1]) and torch.equal(v[:, :-1], want[1, :, :-1])
        assert torch.isnan(k[:, -1]).all()                 # the last position is vLLM's to compute


def test_only_positions_beyond_the_local_hit_are_written(pool):
    tokens = list(range(1, 3 * C + 6))
    store_context(pool, tokens, 3)
    sched, worker, layout = sides(pool)
    blocks = [5, 17, 2, 30, 11, 8, 21]
    ext, meta = schedule(sched, Request("r", tokens), blocks, 0, 5, local=3 * BS)
    assert ext == 3 * C - 3 * BS
    run_step(worker, meta)
    for b in blocks[:3]:                                       # shared prefix-cache blocks: untouched
        assert torch.isnan(worker.caches[1][b]).all()
    assert not torch.isnan(worker.caches[1][blocks[3]]).any()


def test_a_missing_record_reports_its_blocks_and_writes_nothing_from_there(pool):
    tokens = list(range(1, 3 * C + 6))
    keys, _ = store_context(pool, tokens, 3)
    lossy = LosingPool(pool, {keys[1][2].digest})              # chunk 1, last layer
    sched, worker, layout = sides(lossy)
    blocks = [5, 17, 2, 30, 11, 8, 21]
    ext, meta = schedule(sched, Request("r", tokens), blocks, 0, 5)
    assert ext == 3 * C                                       # the index holds it: the read finds out
    run_step(worker, meta)
    assert worker.load_errors() == set(blocks[2:6])            # chunk 1 on: vLLM recomputes them
    assert not torch.isnan(worker.caches[2][blocks[0]]).any()  # chunk 0 loaded
    assert torch.isnan(worker.caches[2][blocks[2]]).all()      # never a wrong block
    assert worker.load_errors() == set()                       # reported once


def test_full_chunks_are_saved_under_kvflows_keys_with_the_blocks_contents(pool):
    tokens = list(range(1, 2 * C + 10))
    sched, worker, layout = sides(pool)
    blocks = [3, 9, 14, 1, 6]
    k = torch.randn(L, len(tokens), H, D)
    v = torch.randn(L, len(tokens), H, D)
    for layer in range(L):          # what vLLM's forward computed into the blocks
        layout.write(worker.caches[layer], slot_mapping(blocks, 0, len(tokens), BS), k[layer], v[layer])
    ext, meta = schedule(sched, Request("r", tokens), blocks, 0, len(tokens))
    assert ext == 0 and [[i for i, _ in s.chunks] for s in meta.saves] == [[0, 1]]
    run_step(worker, meta)
    keys = chunk_keys(tokens, FP, C, layer_groups(L, 1))      # what kvflow serve's Restorer looks up
    got = pool.get_many([key for row in keys for key in row])
    for i, row in enumerate(keys):
        for layer, key in enumerate(row):
            rec = got[key]
            assert rec.shape == (1, 2, H, C, D)
            assert torch.equal(rec[0, 0], k[layer, i * C:(i + 1) * C].transpose(0, 1))
            assert torch.equal(rec[0, 1], v[layer, i * C:(i + 1) * C].transpose(0, 1))
    assert worker.counters["records_written"] == 2 * L


def test_chunks_are_saved_once_as_chunked_prefill_and_decode_fill_them(pool):
    tokens = list(range(1, 3 * C + 1))
    sched, worker, _ = sides(pool)
    req = Request("r", tokens[:C + 10])
    _, meta = schedule(sched, req, [1, 2, 3], 0, 40)            # 40 of the prompt: no full chunk yet
    assert meta.saves == []
    meta = sched.build([], [("r", False, None, 40)], {"r": C + 10 - 40}, {})
    assert [[i for i, _ in s.chunks] for s in meta.saves] == [[0]]
    meta = sched.build([], [("r", False, [4], C + 10)], {"r": 1}, {})   # a decode step
    assert meta.saves == []
    req.all_token_ids = tokens                                   # decoding filled chunk 1
    meta = sched.build([], [("r", False, None, 2 * C - 1)], {"r": 1}, {})
    assert [[i for i, _ in s.chunks] for s in meta.saves] == [[1]] and meta.saves[0].block_ids == [3, 4]


def test_a_step_that_ran_on_a_failed_load_saves_nothing_and_is_saved_again_later(pool):
    tokens = list(range(1, 3 * C + 6))
    keys, _ = store_context(pool, tokens, 2)
    lossy = LosingPool(pool, {keys[0][0].digest})
    sched, worker, _ = sides(lossy)
    blocks = list(range(1, 8))
    ext, meta = schedule(sched, Request("r", tokens), blocks, 0, len(tokens) - 2 * C)
    assert ext == 2 * C and meta.saves
    run_step(worker, meta)
    errors = worker.load_errors()
    assert errors == set(blocks[:4]) and worker.counters["records_queued"] == 0
    sched.invalid_blocks(errors)                               # vLLM hands them to the scheduler side
    meta = sched.build([], [("r", False, None, 0)], {"r": len(tokens)}, {})    # the recompute
    assert [[i for i, _ in s.chunks] for s in meta.saves] == [[0, 1, 2]]


def test_a_finished_request_is_forgotten(pool):
    sched, _, _ = sides(pool)
    schedule(sched, Request("r", list(range(C + 3))), [1, 2, 3], 0, C + 3)
    sched.finished("r")
    assert sched.build([], [("r", False, None, C + 3)], {"r": 1}, {}).saves == []
