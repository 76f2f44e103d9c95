"""The resolved config as YAML with each field's description and default as comments (``rlray config --describe``)."""

from __future__ import annotations

import json
import textwrap

import yaml
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

WIDTH = 110  # comment lines wrap at this column


def described_yaml(model: BaseModel) -> str:
    """Returns ``model`` as YAML in which every field is preceded by comments: its description (with its unit) and
    its default, and every section by its docstring's first line. Loading the text gives ``model.model_dump(mode="json")``.
    """
    return "\n".join(_lines(model, 0)).lstrip("\n") + "\n"


def _lines(model: BaseModel, depth: int) -> list[str]:
    pad = "  " * depth
    values = model.model_dump(mode="json")
    out: list[str] = []
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            doc = " ".join((type(value).__doc__ or "").split())
            out += [""] * (depth == 0) + _comment(doc, pad) + [f"{pad}{name}:"]
            out += _lines(value, depth + 1)
            continue
        default = to_jsonable_python(field.get_default(call_default_factory=True), fallback=str)
        comment = f"{field.description or ''} Default: {json.dumps(default)}."
        out += _comment(comment.strip(), pad)
        text = yaml.safe_dump({name: values[name]}, sort_keys=False, width=10**6).rstrip("\n")
        out += [pad + line for line in text.splitlines()]
    return out


def _comment(text: str, pad: str) -> list[str]:
    """Returns ``text`` as YAML comment lines at indent ``pad``, wrapped at ``WIDTH`` (words and hyphenated names whole)."""
    return textwrap.wrap(text, width=WIDTH, initial_indent=f"{pad}# ", subsequent_indent=f"{pad}#   ",
                         break_on_hyphens=False, break_long_words=False) or [f"{pad}#"]
