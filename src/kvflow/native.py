"""kvflow's native ops: one library built from ``csrc/*.cpp``, once per machine, loaded into any process that asks.

    torch.ops.kvflow.paged_decode    a step's decode queries over their keys, read in place (engine/paged_decode.py)
    torch.ops.kvflow.rms_norm        a decoder layer's elementwise parts, each one op instead of 3-8
    torch.ops.kvflow.add_rms_norm        (model/layer.py, model/linear.py)
    torch.ops.kvflow.rotary_
    torch.ops.kvflow.silu_mul

They are host-only, fp32, and run on torch's own thread pool (at::parallel_for; built with -fopenmp, which shares
torch's libgomp). torch's extension builder (ninja + g++, ~30 s on the 2-vCPU box) writes the library into
``$KVFLOW_HOME/kernels/<digest>/``, the digest being of the sources and flags, so a changed source builds anew and
every later process loads the built file directly. ``make setup`` builds it (:func:`build`), so no request waits for
a compiler. Where it cannot be built (no compiler, no headers) every caller keeps its torch path and says so once;
the results agree within the exactness bounds either way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(sorted(Path(__file__).with_name("csrc").glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).with_name("csrc").glob("*.h")))
OPS = ("paged_decode", "rms_norm", "add_rms_norm", "rotary_", "silu_mul", "paged_chunks", "chunk_attention")

_lock = threading.Lock()
_state: dict[str, object] = {}     # "ok": bool once tried, "error": why not


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]       # OpenMP: at::parallel_for runs on torch's own pool (libgomp is loaded once)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


def build_dir() -> Path:
    """Where the library is built: ``$KVFLOW_HOME/kernels``."""
    return Path(os.environ.get("KVFLOW_HOME", Path.home() / ".cache" / "kvflow")) / "kernels"


def loaded() -> bool:
    """Whether the library is loaded (building it now if not yet built on this machine); a build that fails is
    logged once and the answer stays False for the process."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return bool(_state["ok"])


def _has_ops() -> bool:
    return all(hasattr(torch.ops.kvflow, op) for op in OPS)


def _load() -> bool:
    if _has_ops():
        return True
    flags = _flags()
    text = b"".join(p.name.encode() + p.read_bytes() for p in SOURCES + HEADERS)
    digest = hashlib.sha256(text + " ".join(flags + [torch.__version__]).encode()).hexdigest()[:12]
    name = f"kvflow_native_{digest}"
    where = build_dir() / digest
    built = where / f"{name}.so"
    try:
        if built.is_file():                   # built by an earlier process: loaded as it is (the builder's own
            torch.ops.load_library(str(built))    # up-to-date check costs seconds)
            return _has_ops()
        from torch.utils.cpp_extension import load
        where.mkdir(parents=True, exist_ok=True)
        log.warning("building kvflow's native ops (once per machine, ~30 s) in %s", where)
        load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
             build_directory=str(where), is_python_module=False, verbose=False)
        return _has_ops()
    except (OSError, RuntimeError, ImportError, SystemExit) as err:   # no compiler, no headers, a failed build
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        _state["error"] = first
        log.warning("kvflow's native ops not built (%s): the torch paths run instead", first)
        return False


def build() -> str:
    """Build (or load) the library now and say so in one line: ``make setup`` runs it, so no request waits."""
    return "native ops: " + ("ready" if loaded() else f"not built ({_state.get('error')})")
