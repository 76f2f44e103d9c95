"""Base pieces of the config schema: the error type, the section base class and core-list values."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict


class ConfigError(ValueError):
    """A config that cannot be used. The message names the dotted key, the value and the fix."""


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


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
