"""Reading a config: TOML files, ``key=value`` overrides, ``[overrides.<device>]`` tables, each value checked against
its field's annotation, then the preset and the checks; and the field reference ``gspo config`` prints.

A config is built in three layers: the dataclass defaults, the TOML file, then ``key=value`` overrides from the
command line (``loss.eps_high=5e-4``). Fields left at ``None`` are filled by the algorithm preset, so choosing
``algorithm = "grpo"`` changes every knob GRPO needs while anything the user set explicitly wins. A TOML table
``[overrides.cpu]`` (or ``[overrides.cuda]``) of dotted keys applies only on that device, which is how the
quickstart runs a small CPU version and the full reference settings on a GPU with one file.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from gspo.config.checks import check_device, validate
from gspo.config.presets import apply_preset
from gspo.config.schema import Config, flatten, unknown_key
from gspo.errors import UserError
from gspo.runtime import resolve_device


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (ints are accepted for floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except UserError as e:
                errors.append(e)
        raise errors[0]
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise UserError(f"Config key {key!r} must be a list, got {value!r}; write it as [a, b].")
        if dataclasses.is_dataclass(item_tp):
            return [_build(item_tp, v, f"{key}[{i}].") for i, v in enumerate(value)]
        return [_coerce(v, item_tp, key) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise UserError(f"Config key {key!r} = {value} is too large for a float; use a finite number.") from None
    if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
        raise UserError(f"Config key {key!r} must be {tp.__name__}, got {value!r:.80} ({type(value).__name__}); "
                        "fix its value.")
    if tp is float and not math.isfinite(value):
        # NaN passes every comparison a range check makes; inf makes a limit or a rate meaningless.
        raise UserError(f"Config key {key!r} = {value} is not a finite number; give a finite value.")
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise UserError(f"Config section {prefix.rstrip('.')!r} must be a table, got {data!r}.")
    hints = _hints(cls)
    names = _fields(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise unknown_key(key, names, prefix)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, tp, prefix + key)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UserError(f"Override {dotted!r} goes through {p!r}, which is not a table.")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as TOML (numbers, booleans, lists, quoted strings), else a bare string."""
    if "=" not in text:
        raise UserError(f"Override {text!r} is not key=value; write it as e.g. loss.eps_high=5e-4.")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise UserError(f"Override {text!r} has no key before '='; write it as e.g. loss.eps_high=5e-4.")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        value = raw
    return key.strip(), value


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"Config file {str(p)!r} does not exist; pass the path of a TOML file (see configs/).")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"Config file {str(p)!r} is not UTF-8 text (byte {e.start}); save it as UTF-8 TOML.") from None
    except OSError as e:
        raise UserError(f"Config file {str(p)!r} cannot be read ({e.strerror or e}); check its permissions.") from None
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise UserError(f"Config file {str(p)!r} is not valid TOML ({why}); fix that line.") from None


def build_config(data: dict[str, Any] | None = None, overrides: list[str] | None = None, *, device: str | None = None,
                 checked: bool = True) -> Config:
    """A validated :class:`Config` from a TOML-shaped dict, ``key=value`` overrides and the resolved device type.
    ``checked=False``: every value typed, but the settings not yet checked against each other (what a first pass that
    only reads ``model.device`` needs: the checks belong to the settings the run uses, its device's table applied)."""
    tree = copy.deepcopy(data or {})
    device_overrides = tree.pop("overrides", {}) or {}
    if not isinstance(device_overrides, dict) or not all(isinstance(v, dict) for v in device_overrides.values()):
        raise UserError("The config's [overrides] must hold tables of dotted keys per device, like "
                        "[overrides.cpu] \"train.steps\" = 8; fix or remove it.")
    if device is not None and device in device_overrides:
        for k, v in flatten(device_overrides[device]).items():
            _set_dotted(tree, k, v)
    for text in overrides or []:
        k, v = parse_override(text)
        _set_dotted(tree, k, v)
    cfg = _build(Config, tree)
    if not checked:
        return cfg
    apply_preset(cfg)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: list[str]) -> Config:
    """The config a command runs with: built twice, first to learn model.device, then with that device's
    ``[overrides.<type>]`` table, and checked only then (``train.steps=6`` on a CPU whose table sets
    ``train.minibatches = 2`` is a valid run, though not with the file's 4)."""
    data = load_toml(path) if path else {}
    name = build_config(data, overrides, checked=False).model.device
    check_device(name)  # the one setting the first pass uses: checked before it is looked up
    device = resolve_device(name).type
    return build_config(data, overrides, device=device)


def field_docs(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every field, read from the source: the reference in the README."""
    import ast
    import inspect

    src = ast.parse(inspect.getsource(cls))
    docs: dict[str, str] = {}
    body = src.body[0].body
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = " ".join(str(b.value.value).split())
    rows = []
    hints = _hints(cls)
    inst = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(field_docs(tp, f"{prefix}{f.name}."))
        else:
            rows.append((prefix + f.name, repr(getattr(inst, f.name)), docs.get(f.name, "")))
    return rows
