"""Typed configuration: dataclasses from YAML presets plus `key=value` overrides.

A preset is a YAML mapping whose keys mirror the dataclass fields. It may name
other presets to start from:

    defaults: [models/tiny-moe.yaml, algorithms/gspo.yaml]   # paths relative to this file
    algorithm: {eps_low: 3.0e-4}

Later entries override earlier ones; the file's own keys override its defaults;
command-line overrides (`algorithm.eps_high=4e-4`, dotted paths, values parsed as
YAML) override everything. Unknown keys are errors that name the key and the
closest valid ones, before anything starts.

Paths in a preset: a value of a path key (`path`, `dir`, `tokenizer`, `resume`)
that starts with `./` or `../` is relative to the YAML file that wrote it and is
made absolute when that file is read, so `configs/models/qwen3-30b-a3b.yaml` can
say `path: ./qwen3-30b-a3b` and any preset including it, from any working
directory, gets the right directory. Any other relative path (`outputs/tiny-moe`)
stays relative to the working directory, as do paths given on the command line.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message says which and how to fix it."""


IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
"""A user's function or class given in the config: package.module:name."""


def is_import_path(value: str) -> bool:
    """Whether `value` is written 'package.module:name' (not whether it imports: megatron_rl.plugins checks that)."""
    return bool(IMPORT_PATH.fullmatch(value))


def check_name_or_import_path(key: str, value: str, names: tuple[str, ...], kind: str) -> None:
    """`value` of config `key` is one of the built-in `names` or an import path 'package.module:function', else a
    ConfigError listing them (`kind` names the thing: "a policy loss")."""
    if value not in names and not is_import_path(value):
        raise ConfigError(f"{key}={value!r} is not {kind}; valid names: {', '.join(names)}, "
                          "or an import path 'package.module:function'")


def check_at_least(key: str, value: float, minimum: int, meaning: str = "") -> None:
    """A ConfigError `key=value: must be >= minimum (meaning)` when `value` is below `minimum`; `meaning` says
    what the bound or a 0 means, when it means something."""
    if value < minimum:
        raise ConfigError(f"{key}={value}: must be >= {minimum}" + (f" ({meaning})" if meaning else ""))


def _closest(name: str, valid: list[str]) -> str:
    near = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    if near:
        return f"did you mean {', '.join(repr(n) for n in near)}?"
    return f"valid keys: {', '.join(sorted(valid))}"


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Turn a YAML value into `annotation`, or raise ConfigError naming `where`."""
    origin = get_origin(annotation)
    if annotation is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} fits none of {annotation}")
    if origin is Literal:
        choices = get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {list(choices)}")
        return value
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {annotation.__name__} fields, got {value!r}")
        return from_dict(annotation, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_type, *_) = get_args(annotation) or (Any,)
        items = [_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a nested dict, checking every key and type."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in fields:
            raise ConfigError(f"unknown config key {path!r}: {_closest(key, list(fields))}")
        kwargs[key] = _coerce(value, hints[key], path)
    try:
        obj = cls(**kwargs)
    except TypeError as err:  # a required field is missing
        raise ConfigError(f"{where or cls.__name__}: {err}") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def to_dict(obj: Any) -> Any:
    """A dataclass as plain nested dicts and lists (for YAML, logging, checkpoints)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {key: to_dict(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def deep_merge(base: dict, update: dict) -> dict:
    """`update` over `base`, recursively for nested mappings; neither is modified."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_yaml_preset(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> dict:
    """Read a preset and the presets its `defaults` list names, merged in order."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"preset {path} includes itself through {' -> '.join(map(str, _seen))}")
    if path.is_dir():
        named_by = f"preset {str(_seen[-1])!r} includes {str(path)!r} (defaults:), which" if _seen else f"config file {str(path)!r}"
        raise ConfigError(f"{named_by} is a directory, not a YAML file: name a preset file, e.g. configs/tiny-gspo.yaml")
    if not path.is_file():
        if _seen:  # named by another preset's defaults
            raise ConfigError(f"preset {str(_seen[-1])!r} includes {str(path)!r} (defaults:), which does not exist: fix the "
                              f"name in its defaults list (relative to {str(_seen[-1].parent)!r}) or create the file")
        raise ConfigError(f"config file {str(path)!r} does not exist; pass a YAML preset such as configs/tiny-gspo.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at top level, got {type(data).__name__}")
    merged: dict = {}
    for include in data.pop("defaults", []) or []:
        merged = deep_merge(merged, load_yaml_preset(path.parent / include, _seen + (path,)))
    return deep_merge(merged, resolve_preset_paths(data, path.parent))


def read_json_file(path: Path, error: type[Exception], fix: str) -> Any:
    """The JSON value in the file at `path` (a model's config.json, a .json dataset); when the file is not JSON,
    `error` naming it and what the parser said, with `fix` (what to do about it)."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{str(path)!r} is not valid JSON ({err}): {fix}") from None


PATH_KEYS = frozenset({"path", "dir", "tokenizer", "resume"})
"""Keys whose `./` or `../` values are resolved against the preset file's directory."""


def resolve_preset_paths(data: dict, base: Path) -> dict:
    """Copy of `data` with `./x` and `../x` values of PATH_KEYS made absolute against `base`."""
    out = {}
    for key, value in data.items():
        if key == "eval_sets" and isinstance(value, dict):  # {name: ./file} is a path under a set's name
            value = {name: {"path": v} if isinstance(v, str) else v for name, v in value.items()}
        if isinstance(value, dict):
            value = resolve_preset_paths(value, base)
        elif key in PATH_KEYS and isinstance(value, str) and value.startswith(("./", "../")):
            value = str((base / value).resolve())
        out[key] = value
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a', 'b', 'c'], value parsed as YAML)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form key.path=value (e.g. algorithm.eps_high=4e-4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each dotted `key=value` in a nested dict (creating sub-mappings)."""
    out = dict(data)
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for key in keys[:-1]:
            child = node.get(key)
            node[key] = dict(child) if isinstance(child, dict) else {}
            node = node[key]
        node[keys[-1]] = value
    return out


def load_config(cls: type[T], path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> T:
    """Preset file (optional) + overrides -> validated `cls` instance."""
    data = load_yaml_preset(path) if path else {}
    data = apply_overrides(data, list(overrides or []))
    return from_dict(cls, data)


def replace(obj: T, **changes: Any) -> T:
    """dataclasses.replace that re-runs validation."""
    new = dataclasses.replace(obj, **changes)
    validate = getattr(new, "validate", None)
    if callable(validate):
        validate()
    return new


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field (for --help style listings)."""
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    docs, body = {}, tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = str(nxt.value.value).strip()
    return docs


__all__ = [
    "ConfigError",
    "apply_overrides",
    "check_name_or_import_path",
    "deep_merge",
    "field_docs",
    "from_dict",
    "is_import_path",
    "load_config",
    "load_yaml_preset",
    "parse_override",
    "replace",
    "resolve_preset_paths",
    "to_dict",
]
