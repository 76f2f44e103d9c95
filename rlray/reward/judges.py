"""Judges (generative reward models): a model reads the prompt and a response, or a prompt's G responses, writes a
verdict, and the verdict is parsed into a score.

**Modes.**

- *pointwise*: one call per (prompt, response). ``pattern`` (one group) finds the score in the output: a number
  within [min_score, max_score], or a label mapped to its number by ``labels``. The first or the last match counts
  (``match``).
- *group* (RULER-style): the G responses of a prompt are judged together in one call and scored relative to each
  other. ``pattern`` has two groups, the response's 1-based position as shown and its score (number or label); the
  caller shuffles the order per call and maps the scores back (``rlray.reward.judge_client``).
- *pointwise with label logprobs* (``logprobs``): one token is generated and the score is the expectation of the
  labels' numbers under the judge's probabilities of their first tokens, renormalised over the labels
  (``soft_score``; G-Eval, Liu et al. 2023, Sec. 2.3, over labels instead of digits). It never fails to parse.

A score that cannot be parsed is a *failed* score (NaN; ``JudgeVerdict.failure`` "parse"), never a silent zero.

**Templates.** ``template`` (the user turn), ``system_prompt`` and ``prefill`` (text the judge's answer starts with,
e.g. ``Verdict:``; the parsed output is the prefill followed by what the judge wrote) are Jinja, rendered in a
sandbox with undefined names as errors, from these variables:

- ``prompt``: the prompt as text (a conversational prompt of one message: its content; of several: one
  ``role: content`` paragraph per message); ``messages``: the prompt as a list of ``{role, content}`` messages;
- ``response`` (pointwise), or ``responses`` (group: the G responses in the order shown to the judge);
- ``columns``: the row's other columns; each is also a variable of its own unless it has one of the names above.

The rendered turns go through the judge tokenizer's chat template (with the generation prompt), then the prefill.

**Records.** ``JudgeSpec`` (a judge's definition, plain values; the Serve user_config), ``JudgeItem`` (one
judgement asked), ``JudgeVerdict`` and ``JudgeReply`` (what comes back). ``JudgeService`` (``judge_service``)
renders, generates and parses.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox

from rlray.reward.functions import RewardFunctionError

MODES = ("pointwise", "group")
# Why a judgement failed ("" when it did not): its output did not parse; the rendered prompt does not fit the judge's
# max_model_len; the template raised (e.g. an undefined name); the judge serves another mode than the caller asks;
# the judge did not answer (timeouts and errors past the client's tries).
FAILURES = ("", "parse", "too_long", "template", "mode", "unavailable")
RESERVED_VARIABLES = ("prompt", "messages", "response", "responses", "columns")


class JudgeError(RewardFunctionError):
    """A judge that cannot be used (a template that does not render on the data, labels the tokenizer cannot tell
    apart); the message names the ``reward.judges[i]`` key and the fix."""


@dataclass(frozen=True)
class JudgeSpec:
    """One judge's definition, as plain values (``rlray.run.build.judge_specs`` makes it from ``reward.judges[i]``).

    Attributes:
        name: the judge's term name (metric ``reward/<name>``).
        mode: "pointwise" or "group".
        model_path: the judge model's local Hugging Face folder.
        template, system_prompt, prefill: Jinja texts (module docstring); system_prompt None: no system turn.
        pattern: the regular expression that finds the score (one group; group mode: position and score).
        labels: (label, number) pairs; empty: the score is a number within [min_score, max_score].
        min_score, max_score: the range of a numeric score (a number outside it fails to parse).
        match: "first" or "last": which match of ``pattern`` counts.
        logprobs: score by the labels' first-token probabilities (pointwise, with labels).
        max_new_tokens: tokens the judge may write (1 with ``logprobs``).
        temperature: the judge's sampling temperature (0.0 greedy).
        seed: the judge's sampling seed, the same at every call.
        backend, dtype, max_model_len, kv_cache_gib, enforce_eager, cpu_threads: the judge's ``RolloutEngine``.
    """

    name: str
    mode: str
    model_path: str
    template: str
    pattern: str
    system_prompt: str | None = None
    prefill: str = ""
    labels: tuple[tuple[str, float], ...] = ()
    min_score: float = 0.0
    max_score: float = 10.0
    match: str = "last"
    logprobs: bool = False
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    backend: str = "vllm"
    dtype: str = "float32"
    max_model_len: int = 2048
    kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    cpu_threads: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JudgeSpec:
        """Returns the spec of ``dataclasses.asdict(spec)`` (a Serve user_config, where tuples became lists)."""
        return cls(**{**data, "labels": tuple((str(k), float(v)) for k, v in data.get("labels", ()))})

    @functools.cached_property
    def definition(self) -> str:
        """Returns a short hash of everything that decides a verdict (the model, texts, parse rule and sampling), a
        part of the judge cache's key."""
        fields = dataclasses.asdict(self)
        for engine_only in ("name", "backend", "kv_cache_gib", "enforce_eager", "cpu_threads"):
            fields.pop(engine_only)
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class JudgeItem:
    """One judgement asked of a judge.

    Attributes:
        prompt: the prompt as the dataset has it (a string or ``{role, content}`` messages).
        responses: the response (pointwise: one) or the G responses in the order shown to the judge (group).
        columns: the prompt row's other columns.
    """

    prompt: str | list[dict[str, Any]]
    responses: tuple[str, ...]
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JudgeVerdict:
    """What a judge said about one ``JudgeItem``.

    Attributes:
        scores: one per response in the order shown; NaN where it failed.
        output: the judge's raw output (the prefill, then the generated text); with ``logprobs`` also the labels'
            probabilities; for a failure without output, the reason.
        failure: "" or one of ``FAILURES``.
        prompt_tokens, output_tokens: tokens the judge read and wrote for it.
    """

    scores: tuple[float, ...]
    output: str
    failure: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class JudgeRequest:
    """A chunk of judgements sent to one judge replica: ``mode`` (what the caller expects the judge to serve) and
    ``items``."""

    mode: str
    items: list[JudgeItem]


@dataclass(frozen=True)
class JudgeReply:
    """A replica's answer to a ``JudgeRequest``.

    Attributes:
        version: the judge's version (``reward.version`` when it was deployed).
        definition: ``JudgeSpec.definition`` of the judge that answered.
        verdicts: one per item, in order.
        judge_s: seconds the replica spent on it (rendering, generating, parsing).
    """

    version: int
    definition: str
    verdicts: list[JudgeVerdict]
    judge_s: float = 0.0


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


def template_context(item: JudgeItem, mode: str) -> dict[str, Any]:
    """Returns the variables the judge's templates see for ``item`` (module docstring)."""
    messages = item.prompt if isinstance(item.prompt, list) else [{"role": "user", "content": item.prompt}]
    context = {k: v for k, v in item.columns.items() if k not in RESERVED_VARIABLES}
    context.update(prompt=prompt_text(item.prompt), messages=messages, columns=dict(item.columns))
    if mode == "group":
        context["responses"] = list(item.responses)
    else:
        context["response"] = item.responses[0]
    return context


def render_turns(spec: JudgeSpec, item: JudgeItem) -> tuple[list[dict[str, str]], str]:
    """Returns (the judge's chat messages, the rendered prefill) for ``item``.

    Raises:
        jinja2.TemplateError: a template raised (e.g. ``jinja2.UndefinedError`` for a name the row lacks).
    """
    context = template_context(item, spec.mode)
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
