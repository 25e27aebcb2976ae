"""KVFlowConnector: vLLM v1 reads and writes the kvflow pool (docs/INTEGRATIONS.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVFlowConnector",
        "kv_connector_module_path": "kvflow.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"config": "/etc/kvflow.yaml"}}'

vLLM runs two instances in two processes; they share nothing but the metadata the scheduler sends each step::

    scheduler process                                    worker process (owns the KV cache tensors)
      get_num_new_matched_tokens: longest stored prefix    start_load_kv: one pool read per layer, all issued now
        in whole pool chunks, capped so >= 1 token is        wait_for_layer_load(layer): wait for that layer's
        computed (read-only view of the pool's index)        records (verified), write them via vLLM's own op
      update_state_after_alloc: the load [start, end)      wait_for_save: copy the chunks that became full this
      build_connector_meta: loads + the chunks whose         step out of the blocks (canonical records), queue
        KV became complete this step (to save)                them for a writer thread (put_many, never waits)
      update_connector_output: failed loads un-save          get_block_ids_with_load_errors: blocks of chunks
                                                             whose record was missing or bad -> vLLM recomputes

Records are kvflow's own (one per chunk x layer, ``[1, 2, H, C, D]``, keys from ``kvflow.chunks.keys`` with the
model fingerprint of ``kvflow.model``), so a context ``kvflow serve`` stored is a hit here and the other way round.

This module imports without vLLM: the engine-independent parts (``ConnectorConfig``, ``SchedulerSide``,
``WorkerSide``) are plain Python over a kvflow pool; only ``KVFlowConnector`` touches vLLM objects.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvflow.chunks.keys import layer_groups, prefix_hashes, record_key
from kvflow.config import check, load_section
from kvflow.errors import ConfigError, KVFlowError
from kvflow.integrations.paged import PagedLayout, check_alignment, slot_mapping, to_record
from kvflow.pool.config import PoolConfig
from kvflow.pool.write_queue import WriteQueue
from kvflow.threads import single_threaded

try:   # vLLM is optional: without it the connector class below is a plain object nothing instantiates
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                    KVConnectorRole)
    HAVE_VLLM = True
except ImportError:            # pragma: no cover - exercised in kvflow's own venv
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole = object, object, None
    HAVE_VLLM = False

log = logging.getLogger("vllm.kvflow" if HAVE_VLLM else "kvflow.vllm")   # inside vLLM: its handlers


# ------------------------------------------------------------------------------------------------ config
LAYOUTS = ("probe", "k-plain", "k-transposed")

@dataclass(slots=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` keys (env ``KVFLOW_CONNECTOR_<KEY>`` overrides scalars)."""
    config: str | None = None        # kvflow YAML/TOML file whose ``pool:`` section is the pool (else KVFLOW_CONFIG)
    pool: dict | None = None         # ... or the ``pool:`` section inline
    fingerprint: str | None = None   # model fingerprint; default: computed from the checkpoint as kvflow serve does
    load: bool = True                # look up and load stored prefixes
    save: bool = True                # store full chunks as they are computed
    min_tokens: int = 0              # ignore pool hits shorter than this many tokens
    load_threads: int = 2            # layers read at once (each read fans out over the pool's device workers)
    write_queue: int = 64            # pending writes before new ones are dropped (counted), never waited for
    refresh_s: float = 0.05          # scheduler: reload the pool index at most this often (another process writes)
    layout: str = "probe"            # block layout: probe (ask vLLM's write op) | k-plain | k-transposed (forced)

    def validate(self) -> None:
        check(self.pool is None or self.config is None, "connector: set either config (a file) or pool (inline), not both")
        check(self.fingerprint is None or re.fullmatch(r"[0-9a-f]{32}", self.fingerprint) is not None,
              f"connector.fingerprint: expected 32 hex digits, got {self.fingerprint!r}")
        check(self.min_tokens >= 0, "connector.min_tokens: must be >= 0")
        check(1 <= self.load_threads <= 64, "connector.load_threads: must be 1..64")
        check(1 <= self.write_queue <= 4096, "connector.write_queue: must be 1..4096")
        check(0 <= self.refresh_s <= 3600, "connector.refresh_s: must be 0..3600 seconds")
        check(self.layout in LAYOUTS, f"connector.layout: must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorConfig:
        return load_section(cls, "connector", dict(extra or {}), env)

    def pool_config(self, env: Mapping[str, str] | None = None) -> PoolConfig:
        env = os.environ if env is None else env
        if self.pool is not None:
            return PoolConfig.load({"pool": self.pool})
        path = self.config or env.get("KVFLOW_CONFIG")
        if not path:
            raise ConfigError("kvflow connector: no pool configured: set kv_connector_extra_config.config to a kvflow YAML/TOML "
                              "file (its pool: section), .pool to the section inline, or KVFLOW_CONFIG")
        return PoolConfig.load(path)


def model_fingerprint(model: str, dtype: torch.dtype | str) -> str:
    """The fingerprint ``kvflow serve --model MODEL`` uses (kvflow.model: config + every weight's bytes)."""
    from kvflow.model import load_model
    name = str(dtype).removeprefix("torch.")
    try:
        return load_model(model, dtype=name).fingerprint
    except KVFlowError as err:
        raise ConfigError(f"kvflow connector: cannot compute the model fingerprint of {model!r} ({err}); set "
                          "kv_connector_extra_config.fingerprint (load_model(PATH).fingerprint in kvflow)") from None


# ------------------------------------------------------------------------------------------------ the pool
_POOLS: dict[str, Any] = {}      # index_dir -> the writable KVPool this process opened (the worker's)
_POOLS_LOCK = threading.Lock()


def open_writer(cfg: PoolConfig):
    """The worker's pool (one writer per index_dir per process)."""
    from kvflow.pool import KVPool
    with _POOLS_LOCK:
        key = os.path.abspath(cfg.index_dir)
        if key not in _POOLS:
            _POOLS[key] = KVPool.open(cfg)
        return _POOLS[key]


def open_reader(cfg: PoolConfig):
    """The scheduler's view: the writer this process holds, else a read-only view of its index on disk."""
    from kvflow.pool import KVPool
    with _POOLS_LOCK:
        if os.path.abspath(cfg.index_dir) in _POOLS:
            return _POOLS[os.path.abspath(cfg.index_dir)]
    return KVPool.open(cfg, readonly=True)


def check_shareable(cfg: PoolConfig) -> None:
    if not cfg.index_dir:
        raise ConfigError("kvflow connector: the pool needs index_dir (and memory devices a path, e.g. "
                          "/dev/shm/kv0): vLLM's scheduler and workers are different processes and share the pool "
                          "through its index")


# ------------------------------------------------------------------------------------------------ metadata
@dataclass
class LoadSpec:
    """Write positions [start, end) of request ``req_id`` from its stored chunks (start block-aligned; end too, or
    one token short of a prompt that ends on a chunk: the last chunk loaded but for the token vLLM computes)."""
    req_id: str
    chunks: list[tuple[int, bytes]]      # (chunk index, prefix hash) of every chunk overlapping [start, end)
    start: int
    end: int
    block_ids: list[int]                 # the request's blocks covering [0, end)


@dataclass
class SaveSpec:
    """Store chunks whose KV is complete after this step (read from the request's blocks)."""
    req_id: str
    chunks: list[tuple[int, bytes]]
    block_ids: list[int]                 # blocks of those chunks, in order (C / bs per chunk)


@dataclass
class KVFlowMetadata(KVConnectorMetadata):
    fingerprint: str = ""
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ scheduler
@dataclass
class _Tracked:
    request: Any                          # vLLM's Request (its all_token_ids grows as tokens are sampled)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0                        # chunks [0, saved) handed to the worker for saving


class SchedulerSide:
    """Matching and bookkeeping; sees vLLM requests only through ``request_id``, ``all_token_ids``."""

    def __init__(self, cfg: ConnectorConfig, pool_cfg: PoolConfig, fingerprint: str, num_layers: int,
                 block_size: int, pool=None):
        check_alignment(pool_cfg.chunk_tokens, block_size)
        if pool is None:
            check_shareable(pool_cfg)
        self.cfg, self.pool_cfg, self.fingerprint = cfg, pool_cfg, fingerprint
        self.chunk, self.block_size = pool_cfg.chunk_tokens, block_size
        self.groups = layer_groups(num_layers, 1)
        self._pool, self._refreshed = pool, 0.0
        self._matched: dict[str, tuple[int, int]] = {}     # req_id -> (local computed, hit end) of the last ask
        self._loads: dict[str, tuple[int, int]] = {}
        self._tracked: dict[str, _Tracked] = {}
        self.counters = Counter(lookups=0, hit_tokens=0, loads=0, saves=0, load_errors=0)

    def pool(self):
        if self._pool is None:
            try:
                self._pool = open_reader(self.pool_cfg)
            except Exception as err:        # the worker has not created it yet: no hits for now, ask again later
                log.warning("kvflow pool not readable yet (%s): no pool hits until it is", err)
                return None
            self._refreshed = time.monotonic()
        elif self._pool.readonly and time.monotonic() - self._refreshed >= self.cfg.refresh_s:
            self._pool.refresh()
            self._refreshed = time.monotonic()
        return self._pool

    def matched(self, req_id: str, token_ids: Sequence[int], num_computed: int) -> int:
        """Tokens beyond ``num_computed`` the pool holds: its stored chunks (whole chunks of the prompt), but at
        least one prompt token left for vLLM to compute. A prompt that ends on a chunk boundary loads its last
        chunk but for the last token (vLLM then computes one token, not the chunk's last block of up to 128)."""
        whole = len(token_ids) // self.chunk * self.chunk
        cap = min(whole, len(token_ids) - 1)
        if not self.cfg.load or cap <= num_computed:
            return 0
        pool = self.pool()
        if pool is None:
            return 0
        self.counters["lookups"] += 1
        hit = min(pool.longest_prefix(list(token_ids[:whole]), self.fingerprint, self.groups), cap)
        extra = hit - num_computed
        if extra <= 0 or extra < self.cfg.min_tokens:
            return 0
        self._matched[req_id] = (num_computed, hit)
        return extra

    def allocated(self, request, num_external: int) -> None:
        rid = request.request_id
        self._tracked.setdefault(rid, _Tracked(request)).request = request
        if num_external > 0:
            _, hit = self._matched.pop(rid)
            self._loads[rid] = (hit - num_external, hit)
            self.counters["hit_tokens"] += num_external

    def build(self, new_reqs, cached, num_scheduled: Mapping[str, int],
              spec_tokens: Mapping[str, Sequence[int]]) -> KVFlowMetadata:
        """``new_reqs``: (req_id, block_ids, num_computed); ``cached``: (req_id, resumed, new_block_ids or None,
        num_computed) — what vLLM's SchedulerOutput carries, one group of blocks."""
        meta = KVFlowMetadata(self.fingerprint)
        computed: dict[str, int] = {}
        for rid, blocks, done in new_reqs:
            if rid in self._tracked:
                self._tracked[rid].block_ids = list(blocks)
                computed[rid] = done
        for rid, resumed, blocks, done in cached:
            t = self._tracked.get(rid)
            if t is None:
                continue
            if resumed:
                t.block_ids = list(blocks or [])
            elif blocks:
                t.block_ids.extend(blocks)
            computed[rid] = done
        for rid, (start, end) in list(self._loads.items()):
            if rid not in computed:
                continue                       # allocated but not scheduled this step: keep it for the next
            del self._loads[rid]
            t = self._tracked[rid]
            # the chunks overlapping [start, end): the last may be loaded but for its last token (``matched``)
            hashes = prefix_hashes(list(t.request.all_token_ids[:-(-end // self.chunk) * self.chunk]),
                                   self.fingerprint, self.chunk)
            first = start // self.chunk
            nblocks = -(-end // self.block_size)
            meta.loads.append(LoadSpec(rid, [(i, hashes[i]) for i in range(first, len(hashes))], start, end,
                                       t.block_ids[:nblocks]))
            self.counters["loads"] += 1
        if self.cfg.save:
            for rid, done in computed.items():
                t = self._tracked[rid]
                tokens = t.request.all_token_ids
                full = min(done + num_scheduled.get(rid, 0) - len(spec_tokens.get(rid, ())), len(tokens)) // self.chunk
                if full <= t.saved:
                    continue
                per = self.chunk // self.block_size
                if len(t.block_ids) < full * per:
                    continue                   # blocks not all known (cannot happen in vLLM's order): save later
                hashes = prefix_hashes(list(tokens[:full * self.chunk]), self.fingerprint, self.chunk)
                meta.saves.append(SaveSpec(rid, [(i, hashes[i]) for i in range(t.saved, full)],
                                           t.block_ids[t.saved * per:full * per]))
                t.saved = full
                self.counters["saves"] += 1
        return meta

    def invalid_blocks(self, block_ids: set[int]) -> None:
        """Blocks whose load failed are recomputed by vLLM: chunks from the first one on are saved again later."""
        if not block_ids:
            return
        self.counters["load_errors"] += 1
        per = self.chunk // self.block_size
        for t in self._tracked.values():
            bad = [i for i, b in enumerate(t.block_ids) if b in block_ids]
            if bad:
                t.saved = min(t.saved, bad[0] // per)

    def finished(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._matched.pop(req_id, None)


# ------------------------------------------------------------------------------------------------ worker
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def layer_index(name: str) -> int:
    """``model.layers.3.self_attn.attn`` -> 3."""
    m = _LAYER_INDEX.search(name)
    if m is None:
        raise ConfigError(f"kvflow connector: cannot tell the layer index of attention layer {name!r}")
    return int(m.group(1))


class WorkerSide:
    """Loads and saves over the worker's KV cache tensors. ``layout(layer) -> PagedLayout`` knows the backend."""

    def __init__(self, cfg: ConnectorConfig, pool, block_size: int,
                 layout: Callable[[int], PagedLayout] | None = None):
        check_alignment(pool.chunk_tokens, block_size)
        self.cfg, self.pool, self.block_size, self.chunk = cfg, pool, block_size, pool.chunk_tokens
        self.layout = layout
        self.caches: list[torch.Tensor] = []
        self.names: dict[str, int] = {}
        self._io = ThreadPoolExecutor(cfg.load_threads, thread_name_prefix="kvflow-load",
                                      initializer=single_threaded)     # no OpenMP team beside vLLM's
        self._inflight: dict[int, Future] = {}
        self._issued, self._phase = 0.0, Counter()   # the current load: when its reads went out, seconds per phase
        self._slots: dict[str, torch.Tensor] = {}    # req_id -> slots of its load's positions [start, end)
        self._loads: list[LoadSpec] = []
        self._fingerprint = ""
        self._failed: dict[str, int] = {}         # req_id -> first chunk (list index) that failed this step
        self._errors: set[int] = set()
        self.counters = Counter(loaded_tokens=0, load_misses=0, records_queued=0)
        self.writes = WriteQueue(self._write, cfg.write_queue, self.counters, name="kvflow-vllm-writer")

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        by_index = sorted((layer_index(n), n) for n in kv_caches)
        if [i for i, _ in by_index] != list(range(len(by_index))):
            raise ConfigError(f"kvflow connector: attention layers {[n for _, n in by_index]} are not layers 0..L-1 once each")
        self.names = {n: i for i, n in by_index}
        self.caches = [kv_caches[n] for _, n in by_index]
        nb, heads, bs, two_d = self.caches[0].shape
        if bs != self.block_size:
            raise ConfigError(f"kvflow connector: KV cache blocks hold {bs} tokens, the scheduler's block size is "
                              f"{self.block_size}: kvflow needs them equal")
        self.heads, self.head_dim = heads, two_d // 2

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    def _key(self, h: bytes, index: int, layer: int):
        return record_key(h, self._fingerprint, index, self.chunk, (layer, layer + 1))

    # -- loading ---------------------------------------------------------------------------------------------
    def start_load(self, meta: KVFlowMetadata) -> None:
        """Issue every layer's reads now (in layer order); ``wait_layer`` consumes them one layer at a time."""
        self._failed.clear()
        self._inflight.clear()
        self._loads, self._fingerprint = list(meta.loads), meta.fingerprint
        if not self._loads:
            return
        self._issued = time.perf_counter()
        self._phase = Counter()
        self._slots = {spec.req_id: slot_mapping(spec.block_ids, spec.start, spec.end, self.block_size)
                       for spec in self._loads}     # the same for every layer
        for layer in range(self.num_layers):
            keys = [self._key(h, i, layer) for spec in self._loads for i, h in spec.chunks]
            self._inflight[layer] = self._io.submit(self.pool.get_many, keys)

    def wait_layer(self, name: str) -> None:
        layer = self.names.get(name)
        fut = self._inflight.pop(layer, None) if layer is not None else None
        if fut is None:
            return
        t0 = time.perf_counter()
        got = fut.result()
        t1 = time.perf_counter()
        self.counters["load_blocked_s"] += t1 - t0
        self._phase["blocked"] += t1 - t0
        shape = (1, 2, self.heads, self.chunk, self.head_dim)
        ks, vs, slots = [], [], []
        for spec in self._loads:
            prior = self._failed.get(spec.req_id, len(spec.chunks))
            recs = []
            for i, h in spec.chunks[:prior]:
                rec = got.get(self._key(h, i, layer))
                if rec is None or tuple(rec.shape) != shape:
                    if rec is not None:
                        log.warning("kvflow record of shape %s, expected %s: a miss", tuple(rec.shape), shape)
                    break
                recs.append(rec)
            if len(recs) < prior:          # never written from here on; vLLM recomputes these blocks
                self.counters["load_misses"] += prior == len(spec.chunks)
                self._failed[spec.req_id] = len(recs)
                bad_from = max(spec.start, spec.chunks[len(recs)][0] * self.chunk) // self.block_size
                self._errors.update(spec.block_ids[bad_from:])
            if not recs:
                continue
            # the valid chunks' positions [spec.start, stop), all at once: one cat per layer, not one op per chunk
            first = spec.chunks[0][0] * self.chunk
            stop = min(spec.end, first + len(recs) * self.chunk)
            kv = torch.cat(recs, dim=3)[0, :, :, spec.start - first:stop - first]       # [2, H, T, D]
            ks.append(kv[0].transpose(0, 1))
            vs.append(kv[1].transpose(0, 1))
            slots.append(self._slots[spec.req_id][:stop - spec.start])
        if slots:
            self.layout(layer).write(self.caches[layer], torch.cat(slots), torch.cat(ks), torch.cat(vs))
        self.counters["load_write_s"] += time.perf_counter() - t1
        self._phase["write"] += time.perf_counter() - t1
        if layer == self.num_layers - 1:
            tokens = sum(spec.end - spec.start for spec in self._loads if spec.req_id not in self._failed)
            self.counters["loaded_tokens"] += tokens
            log.info("kvflow: loaded %d tokens of %d requests (%d failed): %.3f s from issuing the reads to the last "
                     "layer written, of which %.3f s waiting for reads and %.3f s verifying and writing (the rest "
                     "is vLLM computing the layers in between)", tokens, len(self._loads), len(self._failed),
                     time.perf_counter() - self._issued, self._phase["blocked"], self._phase["write"])

    def finish_loads(self) -> None:
        """Layers vLLM never waited for (none in a normal step): load them now so no read outlives the step."""
        for name, layer in self.names.items():
            if layer in self._inflight:
                self.wait_layer(name)

    def load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    # -- saving ----------------------------------------------------------------------------------------------
    def save(self, meta: KVFlowMetadata) -> None:
        """Copy the chunks of ``meta.saves`` out of the blocks (this step's KV is complete) and queue them."""
        if not meta.saves or self.writes.closed:
            return
        self._fingerprint = meta.fingerprint
        per = self.chunk // self.block_size
        items: dict = {}
        for spec in meta.saves:
            if spec.req_id in self._failed:
                continue                # this step ran on a failed load: its KV is wrong, vLLM recomputes it
            keys = [[self._key(h, i, layer) for layer in range(self.num_layers)] for i, h in spec.chunks]
            have = self.pool.contains([k for row in keys for k in row])
            for layer in range(self.num_layers):
                todo = [j for j in range(len(spec.chunks)) if not have[j * self.num_layers + layer]]
                if not todo:
                    continue
                blocks = [b for j in todo for b in spec.block_ids[j * per:(j + 1) * per]]
                k, v = self.layout(layer).read(self.caches[layer], blocks)
                for n, j in enumerate(todo):
                    part = slice(n * self.chunk, (n + 1) * self.chunk)
                    items[keys[j][layer]] = to_record(k[:, part], v[:, part])
        if not items:
            return
        if self.writes.offer(items):
            self.counters["records_queued"] += len(items)

    def _write(self, items: dict) -> int:
        """On the writer thread: store the records the pool does not hold yet (another engine may have)."""
        fresh = {k: t for k, t, ok in zip(items, items.values(), self.pool.contains(items)) if not ok}
        return self.pool.put_many(fresh) if fresh else 0

    def flush(self) -> None:
        self.writes.flush()

    def close(self) -> None:
        if self.writes.closed:
            return
        self.writes.close()
        self._io.shutdown(wait=True)


# ------------------------------------------------------------------------------------------------ vLLM
def cpu_write_op(isa: str, kv_cache_dtype: str = "auto"):
    """vLLM's CPU backend write (``cpu_attn_reshape_and_cache``) for one ISA."""
    from vllm import _custom_ops as ops

    def write(key, value, key_cache, value_cache, slots):
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, kv_cache_dtype)
    return write


class KVFlowConnector(KVConnectorBase_V1):
    """The vLLM v1 connector. Scheduler role: ``SchedulerSide``; worker role: ``WorkerSide`` (see module doc)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        if not HAVE_VLLM:
            raise KVFlowError("kvflow.integrations.vllm.KVFlowConnector runs inside vLLM (vllm is not installed)")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        try:    # vLLM's own hit-source label for the metrics, where this version has it
            from vllm.v1.metrics.cache_hit_source import CacheHitSource
            self._cache_hit_source = CacheHitSource.DISK
        except ImportError:
            pass
        self._cfg = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        pool_cfg = self._cfg.pool_config()
        block_size = vllm_config.cache_config.block_size
        check_alignment(pool_cfg.chunk_tokens, block_size)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            model = vllm_config.model_config
            fp = self._cfg.fingerprint or model_fingerprint(model.model, model.dtype)
            layers = model.get_num_layers(vllm_config.parallel_config)
            self._scheduler = SchedulerSide(self._cfg, pool_cfg, fp, layers, block_size)
            if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
                log.warning("kvflow connector: kv_load_failure_policy is %r: a missing or corrupt record fails its "
                            "request; set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config to "
                            "recompute it instead", self._kv_transfer_config.kv_load_failure_policy)
            log.info("kvflow connector (scheduler): pool %s, chunk %d tokens, block %d, model %s",
                     pool_cfg.index_dir, pool_cfg.chunk_tokens, block_size, fp)
        else:
            par = vllm_config.parallel_config
            if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
                raise ConfigError("kvflow connector: the kvflow connector stores whole layers: tensor/pipeline parallel size "
                                  "must be 1")
            self._layouts: dict[tuple, PagedLayout] = {}
            self._kv_cache_dtype = vllm_config.cache_config.cache_dtype
            if self._kv_cache_dtype not in ("auto", None):
                raise ConfigError(f"kvflow connector: kv cache dtype {self._kv_cache_dtype!r}: kvflow records hold "
                                  "the model's dtype (use the default 'auto')")
            check_shareable(pool_cfg)
            self._worker = WorkerSide(self._cfg, open_writer(pool_cfg), block_size, self._layout)

    @property
    def requires_kv_delivery(self) -> bool:
        return False            # a dropped save is a later miss, never a wrong answer

    # -- worker ----------------------------------------------------------------------------------------------
    def _layout(self, layer: int) -> PagedLayout:
        w = self._worker
        name = next(n for n, i in w.names.items() if i == layer)
        attn = self._vllm_config.compilation_config.static_forward_context.get(name)
        isa = getattr(attn, "isa", None)
        if isa is None:
            raise ConfigError(f"kvflow connector: attention layer {name} has no CPU ISA (only vLLM's CPU backend is supported "
                              "by this connector version)")
        dtype = w.caches[layer].dtype
        if (isa, dtype) not in self._layouts:
            op, how = cpu_write_op(isa), self._cfg.layout
            self._layouts[(isa, dtype)] = (
                PagedLayout.probed(op, w.heads, w.block_size, w.head_dim, dtype) if how == "probe" else
                PagedLayout.fixed(op, w.heads, w.block_size, w.head_dim, k_transposed=how == "k-transposed"))
            log.info("kvflow connector: CPU attention ISA %s, K %s", isa,
                     "transposed [D, bs]" if self._layouts[(isa, dtype)].k_transposed else "[bs, D]")
        return self._layouts[(isa, dtype)]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return                  # chunks are saved whole, all layers at once, in wait_for_save

    def wait_for_save(self):
        self._worker.finish_loads()
        self._worker.save(self._get_connector_metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()
            log.info("kvflow connector (worker): %s", dict(self._worker.counters))

    # -- scheduler -------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched(request.request_id, request.all_token_ids, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVFlowMetadata:
        so = scheduler_output
        new = [(r.req_id, r.block_ids[0], r.num_computed_tokens) for r in so.scheduled_new_reqs]
        c = so.scheduled_cached_reqs
        cached = [(rid, rid in c.resumed_req_ids, c.new_block_ids[i][0] if c.new_block_ids[i] else None,
                   c.num_computed_tokens[i]) for i, rid in enumerate(c.req_ids)]
        return self._scheduler.build(new, cached, so.num_scheduled_tokens, so.scheduled_spec_decode_tokens)

    def update_connector_output(self, connector_output):
        self._scheduler.invalid_blocks(set(getattr(connector_output, "invalid_block_ids", None) or ()))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request.request_id)
        return False, None
