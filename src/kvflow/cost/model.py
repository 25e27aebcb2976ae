"""Cost model: predicted compute time of running a token range through a layer range, and I/O time.

Per decoder layer, c tokens starting at position p (keys seen on average: p + (c+1)/2)::

    t_layer(c, p) = a*c + b*c*(p + (c+1)/2) + d        (linear work, attention, per-call overhead)
    t(c, p, n)    = n * t_layer(c, p) + e               (e: per-step overhead: embedding, rotary, mask)
    head          = final norm + LM head for one position

Fitted by :mod:`kvflow.cost.profiler` on the machine that will run the restoration; saved as JSON.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvflow.errors import ConfigError


@dataclass(slots=True)
class CostModel:
    model: str
    fingerprint: str
    threads: int
    a: float
    b: float
    d: float
    e: float
    head: float
    kv_bytes_per_token_layer: int  # fp32 K+V bytes of one token in one layer
    num_layers: int
    fit: dict = field(default_factory=dict)  # held-out error etc., for display

    def layer_time(self, c: int, p: int) -> float:
        return self.a * c + self.b * c * (p + (c + 1) / 2) + self.d

    def compute_time(self, c: int, p: int, n_layers: int) -> float:
        """Seconds to run c tokens at position p through n_layers layers (one step)."""
        if c <= 0 or n_layers <= 0:
            return 0.0
        return n_layers * self.layer_time(c, p) + self.e

    def short_context_rate(self, chunk: int = 256) -> float:
        """KV bytes per second that recompute produces at short context (position 0, ``chunk``-token steps):
        the denominator of the I/O-to-compute ratio rho (DESIGN.md §5)."""
        t = self.compute_time(chunk, 0, self.num_layers)
        return chunk * self.kv_bytes_per_token_layer * self.num_layers / t

    def bandwidth_for_rho(self, rho: float, chunk: int = 256) -> float:
        return rho * self.short_context_rate(chunk)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_json())
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostModel":
        p = Path(path)
        try:
            data = json.loads(p.read_text())
            return cls(**data)
        except FileNotFoundError:
            raise ConfigError(f"no cost profile at {p}: run `kvflow profile MODEL` first") from None
        except (json.JSONDecodeError, TypeError) as err:
            raise ConfigError(f"cost profile {p} is malformed: {err}") from None


def profiles_dir() -> Path:
    return Path(os.environ.get("KVFLOW_HOME", Path.home() / ".cache" / "kvflow")) / "profiles"


def default_profile_path(model_name: str, fingerprint: str, threads: int) -> Path:
    safe = model_name.replace("/", "_").replace("@", "_").replace("=", "")
    return profiles_dir() / f"{safe}-{fingerprint[:12]}-{threads}t.json"
