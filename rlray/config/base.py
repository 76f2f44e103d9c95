"""Base pieces of the config schema: the error type, the section base class and core-list values."""

from __future__ import annotations

import re
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationInfo, field_validator


class ConfigError(ValueError):
    """A config that cannot be used. The message names the dotted key, the value and the fix."""


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated, and a boolean is
    never read as a number (pydantic's lax mode turns ``learner.lr=true`` into 1.0 without a word)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            kinds = _number_kinds(cls.model_fields[info.field_name].annotation)
            if kinds and bool not in kinds:
                raise ValueError(f"got {str(value).lower()}, a boolean; give a number")
        return value


def _number_kinds(ann: Any) -> set[type]:
    """Returns the scalar types among int, float and bool that an annotation (or its Optional/Union members) holds."""
    members = get_args(ann) if get_origin(ann) in (Union, UnionType) else (ann,)
    return {t for t in members if t in (int, float, bool)}


def _core_list_text(value: Any) -> Any:
    """Reads a one-core list given as a number (``cpu_threads=1`` on the command line parses as 1) as text."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


CoreList = Annotated[str, BeforeValidator(_core_list_text)]
"""A core list such as "0-1", "1" or "0,2-3" (a bare core number is accepted and read as text)."""


_CORE_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")

def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Returns {dotted.key: leaf} for a nested dict. Lists are leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out
