"""The plain-data round trip: workers and checkpoints read configs without Hydra."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from runtime.config.checks import ConfigError
from runtime.config.rules import resolve_auto, validate
from runtime.config.schema import MoesysConfig


def config_to_dict(cfg: Any) -> Any:
    """A dataclass tree as plain dicts and lists (YAML/JSON ready)."""
    return dataclasses.asdict(cfg)


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], key)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping (got {value!r})")
        return _build(tp, value, key)
    if origin in (dict, dict):
        return {k: _convert(v, args[1], f"{key}.{k}") for k, v in (value or {}).items()}
    if origin in (list, list):
        return [_convert(v, args[0], key) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise ConfigError(f"{key}={value!r} is not a {tp.__name__}")
    return value


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            close = difflib.get_close_matches(key, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key {dotted}{hint}")
        kwargs[key] = _convert(value, hints[key], dotted)
    return cls(**kwargs)


def config_from_dict(data: dict) -> MoesysConfig:
    """Rebuild and validate a MoesysConfig from plain data (the inverse of config_to_dict)."""
    cfg = _build(MoesysConfig, data, "")
    resolve_auto(cfg)
    validate(cfg, packages=False)
    return cfg
