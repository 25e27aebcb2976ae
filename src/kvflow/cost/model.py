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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvflow.config import check, from_dict
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
    device: str = "cpu"                      # where the model computed when profiled
    h2d_bytes_per_s: float = 0.0             # pinned host-to-device copy rate (0: none, the host computes)

    # The one place the formula lives: every caller (planner, bounds, simulator, calibration) prices through these.
    def layer_time(self, c: int, p: int, per_call: float | None = None) -> float:
        """One layer, c tokens at positions [p, p+c): linear work + attention over the keys each token sees
        (sum of x+1 for x in [p, p+c)) + the per-call overhead (``per_call`` replaces ``d`` where a bound
        amortises it)."""
        return self.a * c + self.b * (c * p + c * (c + 1) / 2) + (self.d if per_call is None else per_call)

    def step_time(self, tokens: tuple[int, int], n_layers: int) -> float:
        """Seconds of one step: tokens [a, b) through n_layers layers."""
        a, b = tokens
        if b <= a or n_layers <= 0:
            return 0.0
        return n_layers * self.layer_time(b - a, a) + self.e

    def compute_time(self, c: int, p: int, n_layers: int) -> float:
        """Seconds to run c tokens at position p through n_layers layers (one step)."""
        return self.step_time((p, p + c), n_layers)

    def added_time(self, c: int, p: int, n_layers: int) -> float:
        """Seconds c tokens at position p add to a step that runs anyway (beside other sequences' decodes): their
        linear work and attention, without the per-call and per-step overheads the step pays once for all rows."""
        return n_layers * self.layer_time(c, p, per_call=0.0) if c > 0 and n_layers > 0 else 0.0

    def scaled(self, factor: float) -> "CostModel":
        """The same machine running every step ``factor`` times slower."""
        return replace(self, a=self.a * factor, b=self.b * factor, d=self.d * factor, e=self.e * factor,
                       head=self.head * factor)

    def short_context_rate(self, chunk: int = 256) -> float:
        """KV bytes per second that recompute produces at short context (position 0, ``chunk``-token steps):
        the denominator of the I/O-to-compute ratio rho (DESIGN.md §5)."""
        t = self.compute_time(chunk, 0, self.num_layers)
        return chunk * self.kv_bytes_per_token_layer * self.num_layers / t

    def bandwidth_for_rho(self, rho: float, chunk: int = 256) -> float:
        return rho * self.short_context_rate(chunk)

    def loaded_rate(self, link_bytes_per_s: float) -> float:
        """Bytes/s a load reaches the model's memory at over a link of ``link_bytes_per_s``: on a device every byte
        crosses the link, then the host-to-device copy (counted in series: the executor marks a load landed once
        its copy is done); on the host the link alone."""
        if self.h2d_bytes_per_s <= 0:
            return link_bytes_per_s
        return 1.0 / (1.0 / link_bytes_per_s + 1.0 / self.h2d_bytes_per_s)       # an unthrottled link: 1/inf = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(self.to_json())
        except OSError as err:
            raise ConfigError(f"cannot save the cost profile to {p}: {err.strerror or err}") from None
        return p

    def validate(self) -> None:
        """Every term a finite non-negative number, counts positive: a hand-edited or foreign file fails here, not
        in the middle of a plan."""
        for name in ("a", "b", "d", "e", "head"):
            check(getattr(self, name) >= 0, f"cost profile: {name} must be >= 0, got {getattr(self, name)}")
        check(self.threads >= 1 and self.num_layers >= 1 and self.kv_bytes_per_token_layer >= 1,
              "cost profile: threads, num_layers and kv_bytes_per_token_layer must be positive")
        check(self.a + self.b + self.d + self.e > 0, "cost profile: every term is zero")
        check(self.h2d_bytes_per_s >= 0, f"cost profile: h2d_bytes_per_s must be >= 0, got {self.h2d_bytes_per_s}")
        check(isinstance(self.fit, dict), f"cost profile: fit must be a mapping, got {type(self.fit).__name__}")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostModel":
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no cost profile at {p}: run `kvflow profile MODEL` first") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"cost profile {p} is not JSON: {err}") from None
        except OSError as err:
            raise ConfigError(f"cannot read cost profile {p}: {err.strerror or err}") from None
        try:
            return from_dict(cls, data, "cost profile")
        except ConfigError as err:
            raise ConfigError(f"{p} is malformed ({err}); delete it or run `kvflow profile MODEL --force`") from None


def profiles_dir() -> Path:
    return Path(os.environ.get("KVFLOW_HOME", Path.home() / ".cache" / "kvflow")) / "profiles"


def default_profile_path(model_name: str, fingerprint: str, threads: int, device: str = "cpu") -> Path:
    """Where the profile of this model on this machine (and device: a CUDA profile is its own file) lives. The
    folder is checked writable now, so a bad $KVFLOW_HOME is one error line before a profiling run, not a
    traceback after it."""
    safe = model_name.replace("/", "_").replace("@", "_").replace("=", "")
    where = "" if device == "cpu" else f"-{device.replace(':', '')}"
    return writable_dir(profiles_dir(), "KVFLOW_HOME") / f"{safe}-{fingerprint[:12]}{where}-{threads}t.json"


def writable_dir(folder: Path, what: str) -> Path:
    """``folder``, created if needed, after proving a file can be written in it (root ignores mode bits, so
    ``os.access`` is not enough); ConfigError naming ``what`` otherwise."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"{what}: cannot write to {folder}: {err.strerror or err}") from None
    return folder
