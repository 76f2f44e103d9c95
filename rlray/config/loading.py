"""Loading a config: YAML, dotted overrides, validation, and errors that name the key and the nearest valid one."""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Callable
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


def _holds_secret(ann: Any) -> bool:
    """Returns True when an annotation is SecretStr (or Optional of it) or a section with a SecretStr anywhere below."""
    for t in (ann, *get_args(ann)):
        if t is SecretStr:
            return True
        if isinstance(t, type) and issubclass(t, BaseModel) and any(_holds_secret(f.annotation) for f in t.model_fields.values()):
            return True
    return False


def _is_secret(loc: tuple) -> bool:
    """Returns True when the location (e.g. ("checkpoint", "s3")) names a SecretStr field or a section that
    holds one: its input must never be printed. Unknown locations are not secret."""
    ann: Any = Config
    for part in loc:
        models = [t for t in (ann, *get_args(ann)) if isinstance(t, type) and issubclass(t, BaseModel)]
        model = next((m for m in models if isinstance(part, str) and part in m.model_fields), None)
        if model is None:
            return False
        ann = model.model_fields[part].annotation
    return _holds_secret(ann)


def validation_error_lines(err: ValidationError, *, unknown_key_hint: Callable[[str], str],
                           is_secret: Callable[[tuple], bool] = lambda loc: False) -> list[str]:
    """Returns one line per pydantic error, each naming the dotted key (shared by config and sweep files).

    - an unknown key: ``unknown key 'a.b'`` followed by ``unknown_key_hint('a.b')`` (e.g. the nearest valid key);
    - a ``ValueError`` from our validators: ``a.b: <message>`` (the message names the value itself), never the
      section's input, which may hold secrets;
    - any other error: ``a.b=<input>: <message>``, with the input shown as ``'**********'`` where
      ``is_secret(loc)`` is True.

    Args:
        err: the ValidationError of ``model_validate``.
        unknown_key_hint: suffix for an unknown key, from the dotted key ("" for none).
        is_secret: True for an error location whose input must not be printed.
    """
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}'{unknown_key_hint(key)}")
        elif e["type"] == "value_error":
            lines.append(f"{key + ': ' if key else ''}{str(e['msg']).removeprefix('Value error, ')}")
        else:
            shown = "'**********'" if is_secret(e["loc"]) else repr(e.get("input"))
            lines.append(f"{key or '<root>'}={shown}: {e['msg']}")
    return lines


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
        lines = validation_error_lines(err, unknown_key_hint=_suggest, is_secret=_is_secret)
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(lines)) from None


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


def normalized_tree(tree: dict[str, Any]) -> dict[str, Any]:
    """Returns ``tree`` validated and dumped back as plain JSON data: what it lacks takes the schema's defaults, and a
    secret reads ``'**********'`` (a rollback's base config with a snapshot's trained sections put in,
    ``rlray rollback --config``).

    Raises:
        ConfigError: naming each bad key (with the nearest valid key) or value.
    """
    return validate_tree(tree).model_dump(mode="json")


def resume_tree(tree: dict[str, Any], snapshot_uri: str) -> dict[str, Any]:
    """Returns a copy of the config tree ``tree`` (plain JSON data) that resumes from the snapshot at ``snapshot_uri``
    (``rlray rollback``): ``checkpoint.resume_from`` set to it; the S3 keys and ``monitor.webhook_url`` (with the
    ``webhook`` alert) cleared, since secrets are not written to disk: they are given again in the config (or, for S3,
    through the AWS credential chain).

    Raises:
        ConfigError: the tree does not validate (naming each bad key).
    """
    tree = copy.deepcopy(tree)
    tree["checkpoint"]["resume_from"] = snapshot_uri
    tree["checkpoint"]["s3"].update({"access_key_id": None, "secret_access_key": None})
    if tree["monitor"]["webhook_url"] is not None:
        tree["monitor"]["webhook_url"] = None
        tree["monitor"]["alerts"] = [a for a in tree["monitor"]["alerts"] if a != "webhook"]
    validate_tree(tree)
    return tree
