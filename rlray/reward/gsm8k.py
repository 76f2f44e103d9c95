"""Rule-based GSM8K grading (math-verify correctness plus a format rule) and the bounded math-verify machinery.

The built-in verifiers ``gsm8k_correct``, ``gsm8k_format`` and ``math_equal`` (``rlray.reward.verifiers``)
are thin wrappers over this module. Decisions (first release):

- **Format** (verifier ``gsm8k_format``) is 1 when the response *ends with* a ``#### <number>`` line:
  its last non-blank line holds a '####' marker followed by a plain number (optional ``$``, sign,
  thousands commas, decimals; trailing units or a period are allowed: ``#### $1,080.00 dollars.``).
- **Accuracy** (verifier ``gsm8k_correct``) is 1 when the final answer equals the reference under
  math-verify (``math_verify.parse`` + ``math_verify.verify``). The final answer is the text after
  the last '####' marker when there is one (its leading plain number when it starts with one, so
  ``#### 18 eggs, 3 each`` means 18); when there is no '####' answer, math-verify's own extraction
  runs over the whole response (its tail, ``MAX_RESPONSE_CHARS``), so a right answer stated another
  way (``The answer is 18.``) still counts, while only the format term asks for '####'.
- **Threads and hangs.** math-verify's timeouts use ``signal.alarm``, which only works in the main
  thread: with its defaults, ``parse``/``verify`` raise ValueError when called from a Ray actor's or
  a Serve replica's worker thread. We pass ``parsing_timeout=None`` and ``timeout_seconds=None``,
  the documented way to disable the signal timeouts, and bound the work ourselves instead:
  parsing only builds unevaluated sympy trees (``evaluate=False``) and is fast on our capped inputs
  (an answer of at most ``MAX_ANSWER_CHARS`` characters, a response tail of ``MAX_RESPONSE_CHARS``);
  the costly part is ``verify`` evaluating the tree (``9^9^9^9`` never returns), so before it we drop
  every parsed expression that could be expensive (``_is_bounded``: at most ``MAX_EXPR_NODES`` nodes,
  powers only of atoms with numeric exponents ``|e| <= MAX_EXPONENT``, no function calls such as
  factorial). math-verify's string fallback of such an answer is still compared as a string.
  GSM8K references are plain integers, so nothing correct is lost. ``answers_match`` is this bounded
  comparison on its own, shared with the ``math_equal`` verifier.
- ``grade_gsm8k`` never raises on any strings: an unexpected error inside math-verify grades as
  accuracy 0.

Reference: math-verify (github.com/huggingface/Math-Verify) for parsing and equivalence; the '####'
answer convention is GSM8K's (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems").
"""

from __future__ import annotations

import functools
import logging
import re

import sympy

ANSWER_MARKER = "####"
MAX_ANSWER_CHARS = 200
MAX_RESPONSE_CHARS = 2000
MAX_EXPR_NODES = 64
MAX_EXPONENT = 64

logger = logging.getLogger(__name__)

# A plain number at the start of an answer: optional markdown bold, sign and '$', then either
# thousands-grouped digits (1,080) or plain digits, with an optional decimal part.
_LEADING_NUMBER = re.compile(r"^[*\s]*(?P<sign>-?)[\s$]*(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)")
# An arithmetic continuation right after the number ("18/4", "9^9", "2 * 3"): then it is an expression.
_CONTINUES = re.compile(r"^\s*(?:[-+*/^×÷]|\*\*)\s*[\d(]")


class _DropTimeoutDisabledWarning(logging.Filter):
    """Drops math-verify's once-per-process 'Timeout is disabled' warning: we bound the work ourselves."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def extract_final_answer(text: str) -> str | None:
    """Returns the text after the last '####' marker, up to the end of that line, stripped.

    Returns None when there is no '####' or nothing follows the last one on its line
    (``"#### 18\\nthanks"`` gives ``"18"``; ``"########"`` gives None).
    """
    if ANSWER_MARKER not in text:
        return None
    tail = text.rsplit(ANSWER_MARKER, 1)[1]
    answer = tail.split("\n", 1)[0].strip()
    return answer or None


def plain_number(answer: str) -> str | None:
    """Returns the leading plain number of ``answer`` normalised for parsing, or None.

    ``"$1,080.50 dollars."`` gives ``"1080.50"``; ``"-10"`` gives ``"-10"``; ``"18/4"``, ``"x = 3"``
    and ``"eighteen"`` give None (not a plain number).
    """
    match = _LEADING_NUMBER.match(answer)
    if match is None or _CONTINUES.match(answer[match.end() :]):
        return None
    return match["sign"] + match["num"].replace(",", "")


def has_answer_line(response: str) -> bool:
    """Returns whether ``response`` ends with a '#### <number>' line (its last non-blank line)."""
    lines = response.strip().splitlines()
    if not lines or ANSWER_MARKER not in lines[-1]:
        return False
    return plain_number(lines[-1].rsplit(ANSWER_MARKER, 1)[1]) is not None


def grade_gsm8k(response: str, reference: str) -> tuple[float, float]:
    """Returns (accuracy, format), each 0.0 or 1.0, for one response against one reference answer.

    See the module docstring for the rules. Thread-safe (no signal-based timeouts) and bounded in
    time on adversarial input; never raises on any strings.

    Args:
        response: the decoded completion (special tokens skipped).
        reference: the reference final answer, e.g. ``"72"`` or ``"1,080"`` (the text after the last '####'
            of a GSM8K solution).
    """
    fmt = 1.0 if has_answer_line(response) else 0.0
    try:
        accuracy = 1.0 if _is_correct(response, reference) else 0.0
    except Exception:  # math-verify or sympy failing on odd input is a wrong answer, not a crash
        logger.debug("grading failed; accuracy 0", exc_info=True)
        accuracy = 0.0
    return accuracy, fmt


def gsm8k_reward(
    responses: list[str], references: list[str], *, correct_weight: float, format_weight: float
) -> dict[str, list[float]]:
    """Returns per-response ``{"reward", "accuracy", "format"}`` lists, each as long as ``responses``.

    ``reward[i] = correct_weight * accuracy[i] + format_weight * format[i]``: the GSM8K demo's reward as
    one function (benchmarks/grpo_vs_trl.py hands it to TRL). A run gets the same numbers from the terms
    ``[{function: gsm8k_correct, weight: correct_weight}, {function: gsm8k_format, weight: format_weight}]``
    (``rlray.reward.scorer.summed_reward`` adds them in that order, bit for bit equal).

    Args:
        responses: decoded completions, B of them.
        references: the reference final answer of each completion's prompt, B of them.
        correct_weight: reward for a correct final answer.
        format_weight: reward for ending with a '#### <number>' line.

    Raises:
        ValueError: ``responses`` and ``references`` differ in length.
    """
    if len(responses) != len(references):
        raise ValueError(f"gsm8k_reward: {len(responses)} responses but {len(references)} references")
    grades = [grade_gsm8k(r, ref) for r, ref in zip(responses, references, strict=True)]
    accuracy = [a for a, _ in grades]
    fmt = [f for _, f in grades]
    reward = [correct_weight * a + format_weight * f for a, f in grades]
    return {"reward": reward, "accuracy": accuracy, "format": fmt}


def _is_correct(response: str, reference: str) -> bool:
    """Returns whether the response's final answer equals ``reference`` under math-verify."""
    final = extract_final_answer(response)
    if final is None:
        text = response[-MAX_RESPONSE_CHARS:]
    else:
        text = plain_number(final) or final[:MAX_ANSWER_CHARS]
    return answers_match(text, reference)


def answers_match(text: str, reference: str) -> bool:
    """Returns whether math-verify finds in ``text`` an answer equal to ``reference``, without signals.

    Bounded in time (module docstring): ``reference`` is parsed as a plain number when it is one, else
    as text, else as LaTeX inside ``$...$`` (``"\\sqrt{2}"``); ``text`` (a final answer such as
    ``"\\boxed{1/2}"``, or a response tail) goes through math-verify's default extraction; unbounded
    parses are dropped before ``verify``. False when either side yields nothing.

    Args:
        text: the answer text, at most ``MAX_RESPONSE_CHARS`` characters (callers cut it).
        reference: the reference answer text, e.g. ``"18"``, ``"0.5"`` or ``"\\frac{1}{2}"``.

    Raises:
        Exception: whatever math-verify or sympy raise on odd input; callers grade that as wrong.
    """
    from math_verify import parse, verify  # at first use: ~0.6 s of CPU (its LaTeX parser) a driver never needs

    gold = _parse_reference(reference)
    if not gold:
        return False
    predicted = [p for p in parse(text, parsing_timeout=None) if _is_bounded(p)]
    return bool(predicted) and verify(list(gold), predicted, timeout_seconds=None)


@functools.lru_cache(maxsize=8192)
def _parse_reference(reference: str) -> tuple:
    """Returns math-verify's parse of a reference answer (plain numbers normalised), bounded items only.

    A reference that math-verify finds nothing in as plain text (bare LaTeX such as ``\\sqrt{2}``) is
    parsed again inside ``$...$``.
    """
    from math_verify import parse

    text = plain_number(reference.strip()) or reference.strip()[:MAX_ANSWER_CHARS]
    parsed = parse(text, parsing_timeout=None) or parse(f"${text}$", parsing_timeout=None)
    return tuple(p for p in parsed if _is_bounded(p))


def _is_bounded(item: object) -> bool:
    """Returns whether math-verify may safely evaluate ``item`` (a parsed answer) without a timeout."""
    if isinstance(item, str):
        return True
    if not isinstance(item, sympy.Basic):  # matrices and anything unexpected
        return False
    for count, node in enumerate(sympy.preorder_traversal(item), start=1):
        if count > MAX_EXPR_NODES or isinstance(node, sympy.Function):
            return False
        if isinstance(node, sympy.Pow):
            exp = node.exp
            if not (node.base.is_Atom and exp.is_Number and abs(exp) <= MAX_EXPONENT):
                return False
    return True
