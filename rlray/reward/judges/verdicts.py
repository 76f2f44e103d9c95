"""The pieces every judge mode (``rlray.reward.judges.modes``) builds on: Jinja templates rendered in a sandbox, the
variables a prompt row gives them, and the parse rules of a verdict (a score by pattern, a group's scores by
position, the labels' expected number from first-token logprobs).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox

from rlray.reward.judges.records import RESERVED_VARIABLES, JudgeError, JudgeItem, JudgeSpec


# --------------------------------------------------------------------------------------------
# Templates
# --------------------------------------------------------------------------------------------
@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    return jinja2.sandbox.ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False)


@functools.cache
def compile_template(text: str) -> jinja2.Template:
    """Returns the compiled Jinja template of ``text`` (cached).

    Raises:
        jinja2.TemplateSyntaxError: ``text`` is not a valid template.
    """
    return _environment().from_string(text)


def template_variables(text: str) -> set[str]:
    """Returns the names a Jinja template reads from its variables (``jinja2.meta.find_undeclared_variables``).

    Raises:
        jinja2.TemplateSyntaxError: ``text`` is not a valid template.
    """
    return jinja2.meta.find_undeclared_variables(_environment().parse(text))


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """Returns a prompt as text: a string as it is; one message: its content; several: ``role: content`` paragraphs."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1:
        return str(prompt[0].get("content", ""))
    return "\n\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt)


def row_variables(item: JudgeItem) -> dict[str, Any]:
    """Returns the template variables of ``item``'s prompt row, the same in every mode (package docstring): the row's
    other columns by name (unless reserved), ``prompt``, ``messages`` and ``columns``; a mode adds its response(s)."""
    messages = item.prompt if isinstance(item.prompt, list) else [{"role": "user", "content": item.prompt}]
    context = {k: v for k, v in item.columns.items() if k not in RESERVED_VARIABLES}
    context.update(prompt=prompt_text(item.prompt), messages=messages, columns=dict(item.columns))
    return context


def render_with(spec: JudgeSpec, context: dict[str, Any]) -> tuple[list[dict[str, str]], str]:
    """Returns (the judge's chat messages, the rendered prefill) of ``spec``'s templates over ``context``.

    Raises:
        jinja2.TemplateError: a template raised (e.g. ``jinja2.UndefinedError`` for a name the row lacks).
    """
    messages = [{"role": "user", "content": compile_template(spec.template).render(context)}]
    if spec.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": compile_template(spec.system_prompt).render(context)})
    return messages, compile_template(spec.prefill).render(context) if spec.prefill else ""


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------
def _value(text: str, spec: JudgeSpec) -> float | None:
    """Returns the number a captured score stands for: its label's number, or the number within the range."""
    text = text.strip()
    if spec.labels:
        return next((v for label, v in spec.labels if label.lower() == text.lower()), None)
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and spec.min_score <= value <= spec.max_score else None


def _matches(output: str, spec: JudgeSpec) -> list[re.Match]:
    found = list(re.finditer(spec.pattern, output))
    return found[::-1] if spec.match == "last" else found


def parse_score(output: str, spec: JudgeSpec) -> float | None:
    """Returns the pointwise score in ``output``: the first or last match of ``spec.pattern`` (``spec.match``) read as
    a label or a number in range, or None when that match is not a score or nothing matches."""
    found = _matches(output, spec)
    return _value(found[0].group(1), spec) if found else None


def parse_group(output: str, spec: JudgeSpec, size: int) -> list[float | None]:
    """Returns the ``size`` scores of a group verdict, by position as shown (None where a position is missing, out of
    1..size, or its score is not a label or a number in range). Per position the first or last match counts."""
    scores: list[float | None] = [None] * size
    seen: set[int] = set()
    for m in _matches(output, spec):
        try:
            position = int(m.group(1)) - 1
        except ValueError:
            continue
        if 0 <= position < size and position not in seen:
            seen.add(position)
            scores[position] = _value(m.group(2), spec)
    return scores


def label_token_ids(tokenizer: Any, labels: Sequence[tuple[str, float]], where: str) -> dict[str, tuple[int, ...]]:
    """Returns each label's first token ids: that of the label, and that of the label after a space (how a model
    writes it after 'Verdict:'), deduplicated.

    Raises:
        JudgeError: a label with no tokens, or two labels that share a first token (names ``where``, both labels
            and the token).
    """
    out: dict[str, tuple[int, ...]] = {}
    owner: dict[int, str] = {}
    for label, _ in labels:
        ids = []
        for text in (label, " " + label):
            encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
            if encoded and encoded[0] not in ids:
                ids.append(int(encoded[0]))
        if not ids:
            raise JudgeError(f"{where}: label {label!r} has no tokens in the judge's tokenizer; use a visible word")
        for t in ids:
            if t in owner and owner[t] != label:
                raise JudgeError(
                    f"{where}: labels {owner[t]!r} and {label!r} start with the same token {tokenizer.decode([t])!r} of "
                    "the judge's tokenizer, so logprobs cannot tell them apart; use labels whose first tokens differ "
                    "(e.g. 'yes'/'no', 'correct'/'wrong')"
                )
            owner[t] = label
        out[label] = tuple(ids)
    return out


def soft_score(logprobs: dict[int, float], label_ids: dict[str, tuple[int, ...]],
               labels: Sequence[tuple[str, float]]) -> tuple[float | None, dict[str, float]]:  # fmt: skip
    """Returns (the labels' expected number, each label's probability), renormalised over the labels.

    ``p(label) = sum of exp(logprob)`` over its first tokens; score = ``sum_l p(l) * value(l) / sum_l p(l)``
    (G-Eval's probability-weighted score, over labels). None when no label has any probability.

    Args:
        logprobs: {token id: logprob (nats)} of the judge's first generated token.
        label_ids: ``label_token_ids``.
        labels: (label, number) pairs.
    """
    mass = {label: sum(math.exp(logprobs[t]) for t in label_ids[label] if t in logprobs) for label, _ in labels}
    total = sum(mass.values())
    if not total > 0.0 or not math.isfinite(total):
        return None, {label: math.nan for label in mass}
    probs = {label: m / total for label, m in mass.items()}
    return sum(probs[label] * value for label, value in labels), probs
