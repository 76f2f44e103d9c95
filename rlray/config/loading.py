"""Loading a config: YAML, dotted overrides, validation, and errors that name the key and the nearest valid one."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, SecretStr, ValidationError

from rlray.config.base import ConfigError
from rlray.config.schema import Config


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_valid_keys(ann, prefix + name + "."))
    return keys


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, _valid_keys(Config), n=1, cutoff=0.5)
    if not close:  # try the leaf name alone, anywhere in the tree
        leaf = key.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[-1]: k for k in _valid_keys(Config)}
        hit = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)
        close = [leaves[hit[0]]] if hit else []
    return f"; did you mean '{close[0]}'?" if close else ""


def _parse_value(text: str) -> Any:
    """Parses an override value with YAML rules ('1e-5' -> float, 'true' -> bool, '[a,b]' -> list)."""
    value = yaml.safe_load(text) if text != "" else ""
    if isinstance(value, str) and value.lower() in {"none", "null"}:
        return None
    # YAML 1.1 reads '1e-5' as a string; accept it as a float as a user would expect.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Returns a copy of ``tree`` with dotted ``key=value`` overrides applied.

    Raises:
        ConfigError: an override without '=' or one whose path crosses a non-mapping value.
    """
    tree = json.loads(json.dumps(tree))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form dotted.key=value (e.g. learner.lr=1e-5)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = tree
        for depth, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{key}': '{'.'.join(parts[: depth + 1])}' is a value, not a section")
            node = nxt
        node[parts[-1]] = _parse_value(raw)
    return tree


def _is_secret(loc: tuple) -> bool:
    """Returns True when the dotted location names a SecretStr field (its value must never be printed)."""
    model: Any = Config
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is None or not isinstance(part, str) or part not in fields:
            return False
        ann = fields[part].annotation
        if SecretStr in get_args(ann) or ann is SecretStr:
            return True
        model = ann
    return False


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}'{_suggest(key)}")
        elif e["type"] == "value_error" and not key:
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            shown = "'**********'" if _is_secret(e["loc"]) else repr(e.get("input"))
            lines.append(f"{key or '<root>'}={shown}: {e['msg']}")
    return "invalid config:\n  - " + "\n  - ".join(lines)


def config_from_dict(tree: dict[str, Any], overrides: list[str] | None = None) -> Config:
    """Returns a validated Config from a nested dict plus dotted overrides.

    Raises:
        ConfigError: naming each bad key (with the nearest valid key) or value.
    """
    return validate_tree(apply_overrides(tree or {}, list(overrides or [])))


def validate_tree(tree: dict[str, Any]) -> Config:
    """Returns a validated Config from a nested dict (a python-mode dump keeps its SecretStr values).

    Raises:
        ConfigError: naming each bad key (with the nearest valid key) or value.
    """
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Returns the validated Config from a YAML file plus dotted ``key=value`` overrides.

    Raises:
        ConfigError: the file is missing, is not a YAML mapping, or fails validation.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file '{path}' is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections, got {type(tree).__name__}")
    try:
        return config_from_dict(tree, overrides)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
