"""Strict construction of nested config dataclasses from YAML dicts and dotted overrides.

Every component owns its config dataclass (one docstring per field); this module only turns
plain dicts into those dataclasses, refusing unknown keys and ill-typed values *before* any work
starts, with a message naming the key and the valid choices (torchtitan-style).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import types
import typing
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A config file or override names an unknown key or holds an ill-typed or out-of-range value."""


def valid_range(ge=None, gt=None, le=None, lt=None) -> str:
    """``>= 0``, ``(0, 1]``, ... for the bounds given (at most one lower and one upper)."""
    lo = (f"[{ge}", f">= {ge}") if ge is not None else (f"({gt}", f"> {gt}") if gt is not None else None
    hi = (f"{le}]", f"<= {le}") if le is not None else (f"{lt})", f"< {lt}") if lt is not None else None
    if lo and hi:
        return f"{lo[0]}, {hi[0]}"
    return (lo or hi or ("any", "any"))[1]


def check_number(key: str, value: Any, *, ge=None, gt=None, le=None, lt=None, integer: bool = False,
                 note: str = "") -> None:
    """A config field's range check, for the sections' ``__post_init__``: ``ValueError`` naming the
    key, the value and the valid range unless ``value`` is a finite number (an int with
    ``integer``) within the bounds. NaN and infinities are always refused."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) \
        and (not integer or isinstance(value, numbers.Integral)) \
        and (ge is None or value >= ge) and (gt is None or value > gt) \
        and (le is None or value <= le) and (lt is None or value < lt)
    if not ok:
        finite = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        kind = "an integer" if integer and not isinstance(value, numbers.Integral) else \
            "a finite number" if not finite else ""
        notes = "; ".join(n for n in (kind, note) if n)
        raise ValueError(f"{key}={value!r} is invalid; valid range: {valid_range(ge, gt, le, lt)}"
                         f"{f' ({notes})' if notes else ''}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` read from YAML or ``--set`` as the field type ``tp`` (``key`` names it in errors)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _coerce_union(value, typing.get_args(tp), key)
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
        if value is None:  # a section left empty in YAML (every key commented out): its defaults
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {sorted(f.name for f in dataclasses.fields(tp))}, "
                              f"got {value!r}")
        return from_dict(tp, value, prefix=f"{key}.")
    return _coerce_scalar(value, tp, key)


def _coerce_union(value: Any, args: tuple, key: str) -> Any:
    """The first of the union's types that ``value`` reads as (None where the union allows it)."""
    if value is None and type(None) in args:
        return None
    for a in args:
        if a is type(None):
            continue
        try:
            return _coerce(value, a, key)
        except ConfigError:
            pass
    raise ConfigError(f"{key}: {value!r} is not a valid {' | '.join(_type_name(a) for a in args)}")


def _coerce_scalar(value: Any, tp: Any, key: str) -> Any:
    """``value`` as a bool, int, float or str field: no silent conversion but YAML's number strings."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # PyYAML (YAML 1.1) reads exponent forms without a dot, e.g. ``1e-5``, as strings.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return number  # (NaN and infinities: refused by from_dict, after the section's own range check)
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
        obj = cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # a component's own __post_init__ validation
        msg, section = str(e), prefix.rstrip(".")
        if section and not msg.startswith((f"{section}.", f"{section}=", f"{section}:")):
            msg = f"{section}: {msg}"  # a message that does not name its section yet
        raise ConfigError(msg) from e
    for key, value in kwargs.items():  # what no section's own check refused: no config float means NaN or inf
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            raise ConfigError(f"{prefix}{key}={value!r} is invalid; valid: finite numbers (no NaN or infinity)")
    return obj


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
                try:
                    node[part] = yaml.safe_load(raw) if raw.strip() else ""
                except yaml.YAMLError as e:
                    why = " ".join(str(getattr(e, "problem", None) or e).split())
                    section = typing.get_type_hints(tp)[part]
                    if dataclasses.is_dataclass(section):  # quoting would not help: a section takes no string
                        keys = sorted(f.name for f in dataclasses.fields(section))
                        hint = f"{path.strip()} is a section: set its keys one by one, e.g. " \
                               f"--set {path.strip()}.{keys[0]}=VALUE (valid keys: {keys})"
                    else:
                        hint = f"quote it for a string, e.g. --set '{path.strip()}=\"{raw}\"'"
                    raise ConfigError(f"override {item!r}: the value {raw!r} is not valid YAML ({why}); "
                                      f"{hint}") from None
            else:
                tp = typing.get_type_hints(tp)[part]
                if not dataclasses.is_dataclass(tp):
                    raise ConfigError(f"{prefix}{part} is not a section; it cannot hold {parts[i + 1]!r}")
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{prefix}{part} must be a mapping in the config file")
    return data
