"""Decode attention read in place from the paged KV cache: a small native op (csrc/paged_decode.cpp), built once.

Without it, a step's decodes are attended by copying their K/V out of the blocks (``index_select``; padded to the
group's longest and one masked SDPA call for short decodes, attention.DecodeGroup; ``one_query``'s two matmuls for
long ones, over views where the blocks are consecutive): every key is read twice and written once. The op takes the
step's queries, one layer of the cache and the decodes' block tables and reads each key's K once for the query
heads' scores and each V once for their weighted sum, over torch's own thread pool; a work item is a sequence (each
key's row of all KV heads read as one run) or, when there are too few sequences to keep the threads busy, one KV
head of one. Per layer, smollm2-135m's shape (9 query / 3 KV heads of 64), consecutive blocks, the 2-vCPU box (noisy:
one run each):

    decodes x keys     in place     one_query over views     one_query over copies
    8 x 1,000           1.1 ms            3.1 ms                   3.9 ms
    8 x 4,000           4.6 ms           11.6 ms                  14.3 ms
    4 x 16,000          7.4 ms           26.6 ms                  33.9 ms
    1 x 4,000           1.0 ms            1.0 ms                   2.0 ms
    1 x 16,000          8.5 ms            7.0 ms                  11.0 ms
    1 x 32,000         19.8 ms           21.4 ms                  51.8 ms

and in an engine, decode steps of smollm2-135m alternated with the grouped copy + SDPA (256-token prompts, p50 of
25): 92 against 113 ms at 8 sequences, 192 against 251 ms at 32; a tie at 1. So every decode of a step goes through
it. Results differ from SDPA's by summation order (~3e-7).

It is built with torch's extension builder into ``$KVFLOW_HOME/kernels`` on first use in a process (~25 s on the
2-vCPU box, once per machine: later processes load the built library) — ``make setup`` builds it — with AVX2 and FMA
where the CPU reports them. Where it cannot be built (no C++ compiler, no headers) or ``$KVFLOW_DECODE_ATTENTION=torch``
the engine keeps the copy + SDPA path; either way the numbers agree within the exactness bounds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from kvflow.config import env_choice

log = logging.getLogger(__name__)

MODES = ("native", "torch")        # $KVFLOW_DECODE_ATTENTION; the first is the default
SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"

_lock = threading.Lock()
_state: dict[str, object] = {}     # "ok": bool once tried, "error": why not


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]       # OpenMP: at::parallel_for runs on torch's own pool (libgomp is loaded once)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


def build_dir() -> Path:
    """Where the op is built: ``$KVFLOW_HOME/kernels``."""
    return Path(os.environ.get("KVFLOW_HOME", Path.home() / ".cache" / "kvflow")) / "kernels"


def available() -> bool:
    """Whether the op is on (``$KVFLOW_DECODE_ATTENTION``) and built (building it now if not yet); a build that
    fails is logged once and the answer stays False for the process."""
    if env_choice("KVFLOW_DECODE_ATTENTION", MODES) != "native":
        return False
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return bool(_state["ok"])


def _load() -> bool:
    if hasattr(torch.ops.kvflow, "paged_decode"):
        return True
    flags = _flags()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags + [torch.__version__]).encode()).hexdigest()[:12]
    name = f"kvflow_paged_decode_{digest}"
    where = build_dir() / digest
    built = where / f"{name}.so"
    try:
        if built.is_file():                   # built by an earlier process: loaded as it is (the builder's own
            torch.ops.load_library(str(built))    # up-to-date check costs seconds)
            return hasattr(torch.ops.kvflow, "paged_decode")
        from torch.utils.cpp_extension import load
        where.mkdir(parents=True, exist_ok=True)
        log.warning("building the paged decode attention op (once per machine, ~25 s) in %s", where)
        load(name=name, sources=[str(SOURCE)], extra_cflags=flags,
             extra_ldflags=["-fopenmp"], build_directory=str(where), is_python_module=False, verbose=False)
        return hasattr(torch.ops.kvflow, "paged_decode")
    except (OSError, RuntimeError, ImportError, SystemExit) as err:   # no compiler, no headers, a failed build
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        _state["error"] = first
        log.warning("paged decode attention op not built (%s): decodes are attended over copies", first)
        return False


def attend(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
           scale: float, window: int | None) -> torch.Tensor:
    """Each decode's query over its keys, read in place (module docstring).

        q [B, Hq, D]   kv_layer [2, slots, Hkv, D] (one layer of PagedKVCache.kv)   tables [B, M]   lengths [B]
        ->  [B, Hq, D]; decode b sees positions [0, lengths[b]), or only the last ``window`` of them
    """
    return torch.ops.kvflow.paged_decode(q.contiguous(), kv_layer, tables, lengths, block_size, scale, window or 0)


def build() -> str:
    """Build (or load) the op now and say so in one line: ``make setup`` runs it, so no request waits for a build."""
    return "paged decode attention op: " + ("ready" if available() else f"not built ({_state.get('error')})")
