"""One loader for every component's config: a dataclass per component, filled from one YAML/TOML file
section, then from ``KVFLOW_<SECTION>_<FIELD>`` environment variables, validated at start-up.

    @dataclass(slots=True)
    class PoolConfig:
        durability: str = "strict"
        ...
    cfg = load_section(PoolConfig, "pool", file_data)       # KVFLOW_POOL_DURABILITY=relaxed overrides

Nested dataclasses and lists of them are filled from nested mappings; only scalar top-level fields take env
overrides. Every problem is a ConfigError naming the section and key, never a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

from kvflow.errors import ConfigError

_SCALARS = (bool, int, float, str)


def read_file(path: str | os.PathLike) -> dict:
    """Parse a YAML (.yaml/.yml) or TOML (.toml) config file into a dict."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} not found")
    try:
        text = p.read_text()
        data = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {p} is not valid {'TOML' if p.suffix == '.toml' else 'YAML'}: "
                          f"{str(err).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping")
    return data


# Sane maxima: a byte count or count beyond these is a typo (``capacity: 1e30``), not a machine.
MAX_INT = 2**62
MAX_FLOAT = 1e15


def _parse_scalar(kind: type, value: Any, where: str):
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        if kind is int:
            return parse_size(text, where)
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}")
    if kind is float and not (math.isfinite(value) and abs(value) <= MAX_FLOAT):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    if kind is int and abs(value) > MAX_INT:
        raise ConfigError(f"{where}: {value} is out of range")
    return value


_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}


def parse_size(text: str | int, where: str = "size") -> int:
    """'64M', '1GiB', '1.5g', '4096' -> bytes (binary units); ConfigError naming ``where`` for anything else
    (``infG``, ``abc``, ``1e30``)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        t = str(text).strip().lower().removesuffix("ib").removesuffix("b")
        scale = 1
        if t and t[-1] in _UNITS:
            t, scale = t[:-1], _UNITS[t[-1]]
        try:
            number = float(t) if any(c in t for c in ".e") else int(t, 10)
        except ValueError:
            number = None
        if (number is None or not math.isfinite(number)
                or (scale == 1 and isinstance(number, float) and not number.is_integer())):
            raise ConfigError(f"{where}: expected int (or a size such as 64M, 1.5G), got {text!r}")
        if abs(number) * scale > MAX_INT:
            raise ConfigError(f"{where}: {text!r} is out of range")
        value = int(number * scale)
    if abs(value) > MAX_INT:
        raise ConfigError(f"{where}: {value} is out of range")
    return value


_parse_size = parse_size   # the old private name, still imported by the pool


def _convert(tp, value: Any, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        try:
            return _convert(args[0], value, where)
        except ConfigError:             # ``int | str``: a size, else a word (``auto``), else the first type's error
            for other in args[1:]:
                try:
                    return _convert(other, value, where)
                except ConfigError:
                    pass
            raise
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)[:1]
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp in _SCALARS:
        return _parse_scalar(tp, value, where)
    return value


def from_dict(cls, data: Mapping | None, where: str):
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and wrong types; then run its
    ``validate()`` if it has one (which raises ConfigError)."""
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(data) - names
    if unknown:         # YAML keys may be numbers, null or dates beside strings: ordered by their text
        first = min(unknown, key=lambda k: (str(k), type(k).__name__))
        raise ConfigError(f"{where}: unknown key {first!r} (known: {', '.join(sorted(names))})")
    kwargs = {k: _convert(hints[k], v, f"{where}.{k}") for k, v in data.items()}
    try:
        obj = cls(**kwargs)
    except TypeError as err:
        raise ConfigError(f"{where}: {err}") from None
    if hasattr(obj, "validate"):
        obj.validate()
    return obj


def load_section(cls, section: str, data: Mapping | None = None, env: Mapping[str, str] | None = None):
    """``data[section]`` (or ``data`` itself when it has no such key) + ``KVFLOW_<SECTION>_<FIELD>`` overrides."""
    env = os.environ if env is None else env
    raw = dict(data or {})
    if section in raw and isinstance(raw[section], Mapping):
        raw = dict(raw[section])
    hints = typing.get_type_hints(cls)
    prefix = f"KVFLOW_{section.upper()}_"
    for f in dataclasses.fields(cls):
        var = prefix + f.name.upper()
        if var in env:
            tp = hints[f.name]
            base = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
            if base[0] not in _SCALARS:
                raise ConfigError(f"{var}: {section}.{f.name} cannot be set from the environment")
            raw[f.name] = env[var]
    return from_dict(cls, raw, section)


def check(cond: bool, message: str) -> None:
    """Validation helper for ``validate()`` methods."""
    if not cond:
        raise ConfigError(message)


# -- environment -----------------------------------------------------------------------------------------------
# Variables kvflow reads besides the ``KVFLOW_<SECTION>_<FIELD>`` overrides.
ENV_VARS = ("KVFLOW_HOME", "KVFLOW_CONFIG", "KVFLOW_TORCH_THREADS", "KVFLOW_BENCH_DISK", "KVFLOW_API_KEY",
            "KVFLOW_VLLM_VENV", "KVFLOW_DEVICE", "KVFLOW_MALLOC", "KVFLOW_LINEAR",
            "KVFLOW_DECODE_ATTENTION", "KVFLOW_CHUNK_ATTENTION",
            "KVFLOW_OMP_SPIN",         # set by kvflow for its children: the spin count is kvflow's (kvflow/threads.py)
            # read by the test suite (make test sets KVFLOW_TEST_VLLM=1), never by kvflow itself
            "KVFLOW_TEST_THREADS", "KVFLOW_TEST_VLLM", "KVFLOW_PEER_TESTS", "KVFLOW_BAD_INPUT_CASES")
# Sections that take env overrides: name -> "module:Class" (imported only to list their fields).
SECTIONS = {"pool": "kvflow.pool.config:PoolConfig", "planner": "kvflow.planner.strategies:PlannerConfig",
            "executor": "kvflow.executor.config:ExecutorConfig",
            "connector": "kvflow.integrations.vllm:ConnectorConfig", "engine": "kvflow.engine.config:EngineConfig",
            "server": "kvflow.server.limits:ServerLimits"}


def env_int(name: str, lo: int, hi: int, env: Mapping[str, str] | None = None) -> int | None:
    """An integer environment variable in [lo, hi], None when unset or empty; ConfigError naming it otherwise."""
    env = os.environ if env is None else env
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text, 10)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer {lo}..{hi}, got {text!r}") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name}: must be {lo}..{hi}, got {value}")
    return value


def env_choice(name: str, choices: tuple[str, ...], env: Mapping[str, str] | None = None) -> str:
    """One of ``choices`` from an environment variable (the first when unset or empty); ConfigError naming it
    otherwise."""
    env = os.environ if env is None else env
    text = env.get(name, "").strip() or choices[0]
    if text not in choices:
        raise ConfigError(f"{name}: expected one of {', '.join(choices)}, got {text!r}")
    return text


def _known_env() -> set[str]:
    known = set(ENV_VARS)
    for section, where in SECTIONS.items():
        module, _, name = where.partition(":")
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
        known |= {f"KVFLOW_{section.upper()}_{f.name.upper()}" for f in dataclasses.fields(cls)}
    return known


def unknown_env(env: Mapping[str, str] | None = None) -> list[str]:
    """One warning per ``KVFLOW_*`` variable kvflow does not read (a misspelling is silently ignored otherwise),
    with the closest known name."""
    env = os.environ if env is None else env
    names = [v for v in env if v.startswith("KVFLOW_")]
    if not names:
        return []
    known = _known_env()
    out = []
    for var in sorted(set(names) - known):
        close = difflib.get_close_matches(var[7:], [k[7:] for k in known], n=1, cutoff=0.75)
        out.append(f"{var} is not a kvflow variable (ignored)" + (f"; did you mean KVFLOW_{close[0]}?" if close else ""))
    return out


def warn_unknown_env(env: Mapping[str, str] | None = None) -> None:
    for line in unknown_env(env):
        print(f"warning: {line}", file=sys.stderr)
