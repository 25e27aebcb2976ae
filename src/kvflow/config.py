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
import os
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


def _parse_scalar(kind: type, value: Any, where: str):
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        try:
            return kind(_parse_size(text) if kind is int else text)
        except ValueError:
            raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}")
    return value


_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _parse_size(text: str) -> int:
    """'64M', '1GiB', '4096' -> bytes (binary units); plain ints pass through."""
    t = text.lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in _UNITS:
        return int(float(t[:-1]) * _UNITS[t[-1]])
    return int(t)


def _convert(tp, value: Any, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, where)
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
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(names))})")
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
