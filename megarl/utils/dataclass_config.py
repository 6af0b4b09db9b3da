"""Strict construction of nested config dataclasses from YAML dicts and dotted overrides.

Every component owns its config dataclass (one docstring per field); this module only turns
plain dicts into those dataclasses, refusing unknown keys and ill-typed values *before* any work
starts, with a message naming the key and the valid choices (torchtitan-style).
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A config file or override names an unknown key or holds an ill-typed value."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} is not a valid {' | '.join(_type_name(a) for a in args)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not a valid choice; valid choices: {list(choices)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {sorted(f.name for f in dataclasses.fields(tp))}, "
                              f"got {value!r}")
        return from_dict(tp, value, prefix=f"{key}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML (YAML 1.1) reads exponent forms without a dot, e.g. ``1e-5``, as strings.
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported config field type {tp!r}")


def _unknown_key(prefix: str, key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown config key {prefix}{key!r}{hint}; valid keys{' of ' + prefix.rstrip('.') if prefix else ''}: {valid}")


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad types raise ``ConfigError``."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(prefix, key, sorted(fields))
        kwargs[key] = _coerce(value, hints[key], f"{prefix}{key}")
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"missing required config keys: {[prefix + m for m in missing]}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # a component's own __post_init__ validation
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from e


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def apply_overrides(data: dict[str, Any], overrides: list[str], cls: type) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested dict, checking each path
    against the dataclass tree of ``cls`` so a typo fails with the valid choices."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value (e.g. rollout.temperature=0.8)")
        path, raw = item.split("=", 1)
        parts = path.strip().split(".")
        node, tp = data, cls
        for i, part in enumerate(parts):
            fields = {f.name: f for f in dataclasses.fields(tp)}
            prefix = ".".join(parts[:i]) + ("." if i else "")
            if part not in fields:
                raise _unknown_key(prefix, part, sorted(fields))
            if i == len(parts) - 1:
                node[part] = yaml.safe_load(raw) if raw.strip() else ""
            else:
                tp = typing.get_type_hints(tp)[part]
                if not dataclasses.is_dataclass(tp):
                    raise ConfigError(f"{prefix}{part} is not a section; it cannot hold {parts[i + 1]!r}")
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{prefix}{part} must be a mapping in the config file")
    return data
