"""Judge modes as objects: the only place that tells the modes apart.

A ``JudgeMode`` says how a judgement is formed and read:

- ``plan``: which samples make one judgement and the order they are shown in (the client; ``JudgeStats.requests``
  counts these judgements);
- ``variables`` and ``render``: the judge's prompt (its chat turns and prefill) for one judgement;
- ``prepare``, ``sampling`` and ``read``: what the judge is asked to generate and how its output becomes scores;
- ``together``: whether a judgement shows a prompt's responses together, which decides the stats of
  ``rlray judge check`` (position bias, the spread within a group; ``rlray.reward.judges.stats``).

``JUDGE_MODES`` holds one object per mode, by name: "pointwise", "group" and "label_logprobs" (pointwise with
``logprobs``). ``judge_mode`` is the one function that picks the object from a judge's ``mode`` and ``logprobs``;
``register_judge_mode`` adds one (a test, a user; the config's ``reward.judges[i].mode`` accepts the built-in names
only, ``rlray.config.judge``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlray.reward.judges.records import JudgeItem, JudgeSpec
from rlray.reward.judges.verdicts import (
    label_token_ids,
    parse_group,
    parse_score,
    render_with,
    row_variables,
    soft_score,
)
from rlray.rollout.types import Completion, SamplingSpec

LabelIds = dict[str, tuple[int, ...]]


class JudgeMode:
    """A judge mode; the base implements pointwise judging, which the others build on: one judgement per sample, its one response shown as
    ``response``, the verdict sampled (``max_new_tokens`` at ``temperature``) and its score found by ``pattern``.

    Attributes:
        name: the mode's key in ``JUDGE_MODES``.
        together: a judgement shows a prompt's responses together (group mode); False: one response per judgement.
    """

    name = ""
    together = False

    def plan(self, n: int, groups: Sequence[int] | None, seed: int) -> tuple[list[list[int]], list[list[int]]]:
        """Returns (the sample indices of each judgement, in batch order, and the order each is shown in:
        ``order[k]`` is the member shown k-th) for B = ``n`` samples: here one judgement per sample.

        Args:
            n: B, the samples.
            groups: B group ids, or None (each sample its own group).
            seed: seeds the order a group is shown in (modes that show groups).
        """
        return [[i] for i in range(n)], [[0] for _ in range(n)]

    def variables(self, item: JudgeItem) -> dict[str, Any]:
        """Returns the template variables of ``item``: the row's (``verdicts.row_variables``) and ``response``."""
        return {**row_variables(item), "response": item.responses[0]}

    def render(self, spec: JudgeSpec, item: JudgeItem) -> tuple[list[dict[str, str]], str]:
        """Returns (the judge's chat messages, the rendered prefill) for ``item``.

        Raises:
            jinja2.TemplateError: a template raised (e.g. ``jinja2.UndefinedError`` for a name the row lacks).
        """
        return render_with(spec, self.variables(item))

    def prepare(self, spec: JudgeSpec, tokenizer: Any, where: str) -> LabelIds:
        """Returns what the mode needs of the judge's tokenizer (the labels' first token ids; none here).

        Raises:
            rlray.reward.judges.JudgeError: the tokenizer does not fit the mode (names ``where``).
        """
        return {}

    def sampling(self, spec: JudgeSpec, label_ids: LabelIds) -> SamplingSpec:
        """Returns the judge's SamplingSpec: ``max_new_tokens`` at ``temperature`` with ``seed``."""
        return SamplingSpec(n=1, max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, seed=spec.seed)

    def read(self, spec: JudgeSpec, output: str, completion: Completion, size: int,
             label_ids: LabelIds) -> tuple[list[float | None], str]:  # fmt: skip
        """Returns (the ``size`` scores by position as shown, None where one did not parse; the output as kept)
        of the judge's ``output`` (the prefill, then the decoded text) and its ``completion``."""
        return [parse_score(output, spec)], output


class Pointwise(JudgeMode):
    """"pointwise": one call per (prompt, response); ``pattern`` (one group) finds the score, a number within
    [min_score, max_score] or a label mapped to its number; the first or last match counts (``match``)."""

    name = "pointwise"


class LabelLogprobs(Pointwise):
    """"label_logprobs" (pointwise with ``logprobs``): one greedy token is generated, and the score is the
    expectation of the labels' numbers under the judge's probabilities of their first tokens, renormalised over the
    labels (``verdicts.soft_score``; G-Eval, Liu et al. 2023, Sec. 2.3, over labels instead of digits). It never
    fails to parse; the kept output ends with the labels' probabilities."""

    name = "label_logprobs"

    def prepare(self, spec: JudgeSpec, tokenizer: Any, where: str) -> LabelIds:
        """Returns each label's first token ids (``verdicts.label_token_ids``).

        Raises:
            rlray.reward.judges.JudgeError: a label with no tokens, or two labels that share a first token.
        """
        return label_token_ids(tokenizer, spec.labels, where)

    def sampling(self, spec: JudgeSpec, label_ids: LabelIds) -> SamplingSpec:
        """Returns one greedy token with the logprobs of the labels' first tokens."""
        asked = tuple(sorted({t for ids in label_ids.values() for t in ids}))
        return SamplingSpec(n=1, max_new_tokens=1, temperature=0.0, logprob_token_ids=asked)

    def read(self, spec: JudgeSpec, output: str, completion: Completion, size: int,
             label_ids: LabelIds) -> tuple[list[float | None], str]:  # fmt: skip
        """Returns ([the labels' expected number], the output with each label's probability)."""
        score, probs = soft_score(completion.token_id_logprobs[0], label_ids, spec.labels)
        shown = ", ".join(f"{label} {p:.3f}" for label, p in probs.items())
        return [score], f"{output} [p: {shown}]"


class Group(JudgeMode):
    """"group" (RULER-style): the G responses of a prompt are judged together in one call and scored relative to
    each other, shown as ``responses`` in an order drawn per group; ``pattern`` has two groups, the response's 1-based
    position as shown and its score (number or label); the client maps the scores back to the samples."""

    name = "group"
    together = True

    def plan(self, n: int, groups: Sequence[int] | None, seed: int) -> tuple[list[list[int]], list[list[int]]]:
        """Returns one judgement per group (in order of first appearance; one per sample when ``groups`` is None),
        each shown in a permutation drawn from ``numpy.random.default_rng(seed)``, one group after the other."""
        if groups is None:
            return super().plan(n, groups, seed)
        by_group: dict[int, list[int]] = {}
        for i, g in enumerate(groups):
            by_group.setdefault(g, []).append(i)
        members = list(by_group.values())
        rng = np.random.default_rng(seed)
        return members, [rng.permutation(len(m)).tolist() for m in members]

    def variables(self, item: JudgeItem) -> dict[str, Any]:
        """Returns the row's template variables and ``responses`` (in the order shown)."""
        return {**row_variables(item), "responses": list(item.responses)}

    def read(self, spec: JudgeSpec, output: str, completion: Completion, size: int,
             label_ids: LabelIds) -> tuple[list[float | None], str]:  # fmt: skip
        """Returns the ``size`` scores of the group by position as shown (``verdicts.parse_group``)."""
        return parse_group(output, spec, size), output


JUDGE_MODES: dict[str, JudgeMode] = {}
"""Every judge mode by name, in registration order (the built-ins first)."""


def register_judge_mode(mode: JudgeMode) -> JudgeMode:
    """Returns ``mode`` after adding it to ``JUDGE_MODES`` under ``mode.name``.

    Raises:
        ValueError: the name is taken or not an identifier.
    """
    if not mode.name.isidentifier():
        raise ValueError(f"judge mode {mode.name!r}: the name must be a Python identifier")
    if mode.name in JUDGE_MODES:
        raise ValueError(f"judge mode {mode.name!r} is already registered; pick another name")
    JUDGE_MODES[mode.name] = mode
    return mode


def judge_mode(name: str, *, logprobs: bool = False) -> JudgeMode:
    """Returns the mode object of a judge's ``mode`` (``JudgeSpec.mode``, ``reward.judges[i].mode``): with
    ``logprobs``, "label_logprobs" (the config allows it with pointwise only).

    Raises:
        KeyError: no mode of that name is registered (the message lists those that are).
    """
    key = LabelLogprobs.name if logprobs else name
    try:
        return JUDGE_MODES[key]
    except KeyError:
        raise KeyError(f"judge mode {key!r} is not registered; registered: {', '.join(JUDGE_MODES)}") from None


def spec_mode(spec: JudgeSpec) -> JudgeMode:
    """Returns the mode object of ``spec`` (``judge_mode`` of its mode and logprobs)."""
    return judge_mode(spec.mode, logprobs=spec.logprobs)


def render_turns(spec: JudgeSpec, item: JudgeItem) -> tuple[list[dict[str, str]], str]:
    """Returns (the judge's chat messages, the rendered prefill) for ``item`` in ``spec``'s mode.

    Raises:
        jinja2.TemplateError: a template raised (e.g. ``jinja2.UndefinedError`` for a name the row lacks).
    """
    return spec_mode(spec).render(spec, item)


register_judge_mode(Pointwise())
register_judge_mode(Group())
register_judge_mode(LabelLogprobs())

