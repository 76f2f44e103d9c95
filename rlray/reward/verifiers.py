"""Built-in verifiers: rule-based reward functions in TRL's convention, run in-process by the scorer.

Each is ``fn(prompts, completions, **kwargs) -> list[float | None]``, TRL's GRPOTrainer reward-function
convention, so the scorer calls them exactly as it calls user functions (``rlray.reward.scorer``):

- ``completions`` are B strings, or B TRL conversational completions (``[{"role": "assistant", "content":
  text}]``); the text graded is the last assistant message's content (``completion_text``);
- the dataset's columns arrive as keyword lists, one value per completion (``answer=[...]``), and the
  entry's ``reward.functions[i].kwargs`` are bound on top (``{"column": "solution"}``, ``{"pattern": ...}``);
- a value is 1.0 or 0.0, or None where the verifier does not apply to that sample (its reference is None
  or empty): the term is *skipped* there and the summed reward uses the other terms.

A reference is the column's value as text: strings as they are, anything else through ``str()``
(``1080`` gives ``"1080"``). Verifiers never raise on any completion text; a math-verify failure on odd
input grades 0.0.

================  ======================  ==========================================================
name              reads                   1.0 when
================  ======================  ==========================================================
math_equal        ``columns[column]``     the final answer (last ``\\boxed{...}``, else math-verify's
                                          extraction over the response tail) equals the reference
exact_match       ``columns[column]``     the completion equals the reference text (``strip``,
                                          ``ignore_case`` options)
regex_match       ``pattern`` (kwargs)    ``re.search`` matches, or ``re.fullmatch`` of the stripped
                                          text with ``fullmatch=True``; flags inline, ``(?ms)``
gsm8k_correct     ``columns[column]``     GSM8K accuracy (``grade_gsm8k``) against the text after
                                          the last '####' of the value (a GSM8K solution), or the
                                          whole value when it has none
gsm8k_format      nothing                 the response ends with a '#### <number>' line
reasoning_gym     ``answer``,             the item's generator scores the answer (``rlray.reward.rgym``:
                  ``reasoning_gym``       reasoning-gym's ``score_answer``, 0-1, partial credit possible)
================  ======================  ==========================================================

``math_equal`` inherits the bound of ``rlray.reward.gsm8k`` (no signal timeouts, so nothing costly is
evaluated): parsed answers holding function calls or large powers are dropped before the comparison, so
``\\boxed{\\log 2}`` does not match the reference ``\\log 2`` nor ``\\boxed{5!}`` the reference 120. It fits
numeric and algebraic answers: integers, decimals, fractions, roots, percentages, polynomials.

``column`` defaults to ``"answer"``. Built-ins run in the scorer's process without a timeout, so a
``regex_match`` pattern should not backtrack catastrophically (``(a+)+$``) on long completions.

Reference: the reward-function convention is TRL's (``GRPOTrainer._calculate_rewards``: keyword
arguments prompts, completions, completion_ids and every dataset column; None means "does not apply").
Math equivalence is math-verify's (github.com/huggingface/Math-Verify), bounded as ``rlray.reward.gsm8k``
describes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from rlray.reward.gsm8k import (
    ANSWER_MARKER,
    MAX_ANSWER_CHARS,
    MAX_RESPONSE_CHARS,
    answers_match,
    extract_final_answer,
    grade_gsm8k,
    has_answer_line,
)
from rlray.reward.rgym import extract_tagged, last_number, score_item

Completion = str | list[dict[str, Any]]
log = logging.getLogger(__name__)
_BOXED = "\\boxed{"


def completion_text(completion: Completion) -> str:
    """Returns the text of one completion: the string itself, or the last assistant message's content.

    A conversational completion is a list of ``{"role", "content"}`` messages (TRL); content given as a
    list of parts keeps its ``{"type": "text", "text": ...}`` parts, joined. No assistant message gives "".
    """
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role") == "assistant":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
            return content if isinstance(content, str) else ""
    return ""


def last_boxed(text: str) -> str | None:
    """Returns the content of the last ``\\boxed{...}`` of ``text`` (braces balanced), or None.

    ``"so \\boxed{3}, no: \\boxed{\\frac{1}{2}}"`` gives ``"\\frac{1}{2}"``; an unclosed last box gives None.
    """
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth = 1
    for i in range(start + len(_BOXED), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len(_BOXED) : i]
    return None


def math_equal(prompts: list, completions: list[Completion], *, column: str = "answer", **columns: Any) -> list[float | None]:
    """Returns 1.0 where the completion's final answer equals ``columns[column]`` under math-verify, else 0.0.

    The final answer is the last ``\\boxed{...}`` (its content, at most ``MAX_ANSWER_CHARS`` characters),
    else whatever math-verify extracts from the last ``MAX_RESPONSE_CHARS`` characters. ``\\boxed{1/2}``
    equals ``"0.5"``; ``\\boxed{1,080}`` equals ``1080``. None where the reference is None or blank.
    """
    refs = _references(columns, column, len(completions))
    return [_math_equal(completion_text(c), ref) for c, ref in zip(completions, refs, strict=True)]


def _math_equal(text: str, reference: str | None) -> float | None:
    if reference is None or not reference.strip():
        return None
    boxed = last_boxed(text)
    answer = text[-MAX_RESPONSE_CHARS:] if boxed is None else _BOXED + boxed[:MAX_ANSWER_CHARS] + "}"
    try:
        return 1.0 if answers_match(answer, reference) else 0.0
    except Exception:  # math-verify or sympy failing on odd input is a wrong answer, not a crash
        log.debug("math_equal: grading failed; 0", exc_info=True)
        return 0.0


def exact_match(prompts: list, completions: list[Completion], *, column: str = "answer", strip: bool = True,
                ignore_case: bool = False, **columns: Any) -> list[float | None]:  # fmt: skip
    """Returns 1.0 where the completion's text equals ``columns[column]`` as text, else 0.0; None where it is None.

    ``strip`` compares both sides without surrounding whitespace; ``ignore_case`` compares them casefolded.
    """

    def norm(text: str) -> str:
        text = text.strip() if strip else text
        return text.casefold() if ignore_case else text

    refs = _references(columns, column, len(completions))
    return [None if ref is None else float(norm(completion_text(c)) == norm(ref)) for c, ref in zip(completions, refs, strict=True)]


def regex_match(prompts: list, completions: list[Completion], *, pattern: str | re.Pattern, fullmatch: bool = False,
                **columns: Any) -> list[float]:  # fmt: skip
    """Returns 1.0 where ``pattern`` matches the completion's text (``re.search``), else 0.0.

    With ``fullmatch`` the pattern must match the whole stripped text (``re.fullmatch``). Flags go inline
    (``(?m)^#### \\d+$``, ``(?s)``). The scorer compiles ``pattern`` when it is built (``prepare_kwargs``).
    """
    rx = re.compile(pattern)
    if fullmatch:
        return [1.0 if rx.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]
    return [1.0 if rx.search(completion_text(c)) else 0.0 for c in completions]


def gsm8k_correct(prompts: list, completions: list[Completion], *, column: str = "answer", **columns: Any) -> list[float | None]:
    """Returns GSM8K accuracy per completion (``grade_gsm8k``), None where ``columns[column]`` is missing or blank.

    The reference is the text after the last '####' of the value (a GSM8K solution, ``"... #### 18"``), or the
    whole stripped value when it has no '####' (a plain final answer, ``"18"`` or ``18``).
    """
    refs = [_gsm8k_reference(ref) for ref in _references(columns, column, len(completions))]
    return [None if ref is None else grade_gsm8k(completion_text(c), ref)[0] for c, ref in zip(completions, refs, strict=True)]


def _gsm8k_reference(value: str | None) -> str | None:
    if value is None:
        return None
    answer = extract_final_answer(value) if ANSWER_MARKER in value else value.strip()
    return answer or None


def gsm8k_format(prompts: list, completions: list[Completion], **columns: Any) -> list[float]:
    """Returns 1.0 where the completion's text ends with a '#### <number>' line (``has_answer_line``), else 0.0."""
    return [1.0 if has_answer_line(completion_text(c)) else 0.0 for c in completions]


def reasoning_gym(prompts: list, completions: list[Completion], *, answer_tag: str | None = "answer",
                  untagged: str | None = None, **columns: Any) -> list[float | None]:  # fmt: skip
    """Returns each completion's reasoning-gym score in [0, 1], None where the row has no item (``rlray.reward.rgym``).

    The answer is the stripped text of the completion's last ``<answer_tag>...</answer_tag>``, or with
    ``answer_tag=None`` the whole stripped text. A completion without the tag has no answer (None: the generator
    scores it 0.0 or a small format credit), or with ``untagged="last_number"`` its last number (``last_number``:
    "58 + 26 = 84" answers "84"), for a model that does not write the tags. The row's ``reasoning_gym`` and
    ``answer`` columns (a ``reasoning-gym:`` data source's) give the item its generator scores (``score_item``).

    Raises:
        ValueError: ``untagged`` is neither None nor "last_number".
    """
    if untagged not in (None, "last_number"):
        raise ValueError(f"rlray: reasoning_gym kwargs untagged={untagged!r}: use null or 'last_number'")
    items = columns.get("reasoning_gym") or [None] * len(completions)
    oracles = columns.get("answer") or [None] * len(completions)
    out: list[float | None] = []
    for prompt, completion, item, oracle in zip(prompts, completions, items, oracles, strict=True):
        text = completion_text(completion)
        answer = text.strip() if answer_tag is None else extract_tagged(text, answer_tag)
        if answer is None and untagged == "last_number":
            answer = last_number(text)
        out.append(score_item(item, prompt, oracle, answer) if isinstance(item, dict) else None)
    return out


BUILTIN_VERIFIERS: dict[str, Callable[..., list[float | None]]] = {
    "math_equal": math_equal,
    "exact_match": exact_match,
    "regex_match": regex_match,
    "gsm8k_correct": gsm8k_correct,
    "gsm8k_format": gsm8k_format,
    "reasoning_gym": reasoning_gym,  # rows of a reasoning-gym: data source, scored by their generator (rlray.reward.rgym)
}


def prepare_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Returns a built-in's bound kwargs with a ``pattern`` compiled, so a bad pattern fails when the scorer is built.

    Raises:
        re.error: ``pattern`` is not a valid regular expression.
    """
    if isinstance(kwargs.get("pattern"), str):
        return {**kwargs, "pattern": re.compile(kwargs["pattern"])}
    return dict(kwargs)


def _references(columns: dict[str, Sequence[Any]], column: str, n: int) -> list[str | None]:
    """Returns the B reference texts of ``column`` (None where a row has none, all None when no row has it)."""
    values = columns.get(column)
    if values is None:
        return [None] * n
    return [None if v is None else v if isinstance(v, str) else str(v) for v in values]
