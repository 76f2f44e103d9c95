"""The schema in words: the resolved config as YAML with each field's description and default as comments
(``rlray config --describe``), and the config reference page, one Markdown table per section
(``rlray config --reference``, written to docs/reference/config.md by ``make docs``)."""

from __future__ import annotations

import json
import re
import textwrap
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, SecretStr
from pydantic_core import PydanticUndefined, to_jsonable_python

WIDTH = 110  # comment lines wrap at this column

# Units read from a field's name (STYLE.md: sizes and times carry their unit as a suffix); first match wins.
UNIT_SUFFIXES = (("_s", "s"), ("_ms", "ms"), ("_gib", "GiB"), ("_days", "days"), ("_tokens", "tokens"),
                 ("_steps", "steps"), ("_turns", "turns"))
_PER = re.compile(r"^(?:\w+_)?(prompts|samples|sequences|pairs|tokens)_per_(step|prompt|minibatch|microbatch|s)$")


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


# --------------------------------------------------------------------------------------------
# The reference page
# --------------------------------------------------------------------------------------------
def reference_markdown(schema: type[BaseModel]) -> str:
    """Returns the config reference of ``schema`` (``rlray.config.Config``) as one Markdown page: for every section,
    nested sections and list entries included (``reward.functions[]``), a heading with the section's docstring and a
    table of its fields: dotted key, type, default, unit (from the name's suffix, ``UNIT_SUFFIXES``; other units are
    in the meaning) and meaning (the field's description). Required fields show "required" as their default.
    """
    out = ["# Config reference", "",
           "Every key of an rlray config, section by section: its type, its default, its unit and what it does. This "
           "page is generated from the schema (`rlray/config/`) by `rlray config --reference`; `make docs` writes it "
           "and a test fails when it is out of date. `rlray config CONFIG --describe` prints one config with the same "
           "descriptions as YAML comments.", "",
           "Set a key in the YAML file, or on the command line as a dotted override: "
           "`rlray train CONFIG learner.lr=1e-5 rollout.samples_per_prompt=8`.", ""]
    for section, key in _sections(schema, ""):
        doc = " ".join((section.__doc__ or "").split())
        out += [f"## `{key}`", "", _cell_text(doc, table=False), "",
                "| key | type | default | unit | meaning |", "|---|---|---|---|---|"]
        for name, field in section.model_fields.items():
            if _section_of(field.annotation) is not None and get_origin(field.annotation) is None:
                continue  # a nested section: its own heading below
            kind = f"list of `{key}.{name}[]` entries" if _section_of(field.annotation) else _cell_text(_type_text(field.annotation))
            out.append("| " + " | ".join((f"`{key}.{name}`", kind,
                                          _default_text(field), _unit(name), _cell_text(field.description or ""))) + " |")
        out.append("")
    return "\n".join(out)


def _sections(model: type[BaseModel], key: str) -> list[tuple[type[BaseModel], str]]:
    """Returns (section class, dotted key) for ``model``'s fields that are sections or lists of them, depth first
    in field order; list entries are keyed ``name[]``. The root itself is not listed."""
    found: list[tuple[type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        sub = _section_of(field.annotation)
        if sub is None:
            continue
        dotted = f"{key}.{name}".lstrip(".") + ("[]" if get_origin(field.annotation) is list else "")
        found.append((sub, dotted))
        found += _sections(sub, dotted)
    return found


def _section_of(ann: Any) -> type[BaseModel] | None:
    """Returns the section class of a field typed as a section or a list of sections, else None."""
    if get_origin(ann) is list:
        ann = get_args(ann)[0]
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _type_text(ann: Any) -> str:
    """Returns a field's type as a reader writes it: ``int``, ``float or null``, ``"vllm" or "hf"``, ``list[str]``."""
    origin = get_origin(ann)
    if origin is Annotated:
        return _type_text(get_args(ann)[0])
    if origin in (Union, UnionType):
        members = [a for a in get_args(ann) if a is not type(None)]
        text = " or ".join(_type_text(a) for a in members)
        return text + " or null" if len(members) < len(get_args(ann)) else text
    if origin is Literal:
        return " or ".join(json.dumps(a) for a in get_args(ann))
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_text(a) for a in get_args(ann))}]"
    if ann is SecretStr:
        return "secret str"
    return "any" if ann is Any else getattr(ann, "__name__", str(ann))


def _default_text(field: Any) -> str:
    """Returns a field's default as JSON in a code span, or "required" for a field without one."""
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = to_jsonable_python(field.get_default(call_default_factory=True), fallback=str)
    return f"`{_cell_text(json.dumps(value), table=True, code=True)}`"


def _unit(name: str) -> str:
    """Returns the unit a field's name carries ("s", "tokens", "prompts per step"), or "" for none."""
    if match := _PER.match(name):
        return f"{match[1]} per {match[2]}"
    return next((unit for suffix, unit in UNIT_SUFFIXES if name.endswith(suffix)), "")


def _cell_text(text: str, *, table: bool = True, code: bool = False) -> str:
    """Returns ``text`` safe in a Markdown table cell (or paragraph): pipes escaped; outside code spans, angle
    brackets as entities (``<run id>`` is no HTML tag) and asterisks escaped (``lr*=0.5`` is no emphasis)."""
    if code:
        return text.replace("|", "\\|")
    parts = re.split(r"(``.+?``|`[^`]+`)", text)  # code spans stay as written
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    joined = "".join(parts)
    return joined.replace("|", "\\|") if table else joined
