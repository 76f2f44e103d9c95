"""RetryArithmeticEnv: one arithmetic question, answered with the number only, retried after "Wrong, try again.".

Row columns: ``a``, ``op`` (``"+"``, ``"-"`` or ``"*"``), ``b``, ``answer`` (the integer result) and optionally
``max_attempts`` (default 3) and ``feedback`` (``"retry"``, the default, or ``"direction"``). Meant as the smallest
multi-turn task SmolLM2-135M can learn on a CPU: sums and differences of numbers 0-50 (``rlray.data.generate``).

Protocol: a turn is a valid action when its text, stripped, is an integer (an optional leading minus sign, an
optional trailing period: ``"42"``, ``"42."``, ``"-7"``) or the question's own expression followed by ``=`` and an
integer (``"37 + 45 = 82"``: SmolLM2-135M-Instruct answers that way, never with the bare number, measured on the
calibration split); anything else (prose, another expression) is invalid and counts as a wrong attempt.
A wrong or invalid attempt with attempts left is answered by a user message: ``"Wrong, try again."`` with
``feedback="retry"``; with ``feedback="direction"``, ``"Wrong: the answer is higher than 41. Try again."`` (or lower)
after a wrong number and ``"Wrong: reply with a number. Try again."`` after an invalid turn.

Reward schedule, given on the last turn only (None before): 1.0 when the first attempt is correct, 0.5 when a
later attempt is, 0.0 when every attempt fails (the episode then ends as truncated). Metrics (summed over an
episode's turns by the rollout): ``valid_action`` each turn (1.0 when the turn was a number), and ``attempts`` on
the last turn (the attempts the episode took).
"""

from __future__ import annotations

import re
from typing import Any

from rlray.envs.base import AssistantTurn, EnvReset, EnvStep

REWARD_FIRST_ATTEMPT = 1.0
REWARD_LATER_ATTEMPT = 0.5
DEFAULT_MAX_ATTEMPTS = 3
RETRY_MESSAGE = "Wrong, try again."
FEEDBACK = ("retry", "direction")
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_ANSWER = re.compile(r"-?\d+\.?")
_EQUATION = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)\s*=\s*(-?\d+)\.?")


def parse_answer(text: str, question: tuple[int, str, int] | None = None) -> int | None:
    """Returns the integer of a number-only answer (``" 42.\\n"`` gives 42), or of ``"a op b = N"`` when (a, op, b) is
    ``question``; None when the text is anything else."""
    stripped = text.strip()
    if _ANSWER.fullmatch(stripped):
        return int(stripped.rstrip("."))
    equation = _EQUATION.fullmatch(stripped)
    if equation and question is not None and (int(equation[1]), equation[2], int(equation[3])) == question:
        return int(equation[4])
    return None


class RetryArithmeticEnv:
    """One arithmetic question with retries (protocol and reward schedule in the module docstring)."""

    def reset(self, *, a: int, op: str, b: int, answer: int, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
              feedback: str = "retry", **row: Any) -> EnvReset:
        """Returns one user message: ``"What is {a} {op} {b}? Answer with the number only."``.

        Raises:
            ValueError: ``op`` is not + - *, ``answer`` is not ``a op b``, ``max_attempts`` < 1, or ``feedback`` is not
                "retry" or "direction".
        """
        if op not in OPERATIONS:
            raise ValueError(f"RetryArithmeticEnv: op={op!r}; use one of {sorted(OPERATIONS)}")
        if OPERATIONS[op](int(a), int(b)) != int(answer) or max_attempts < 1:
            raise ValueError(f"RetryArithmeticEnv: need answer == a {op} b and max_attempts >= 1, got {a=} {b=} {answer=} {max_attempts=}")
        self.answer, self.max_attempts, self.attempts = int(answer), int(max_attempts), 0
        if feedback not in FEEDBACK:
            raise ValueError(f"RetryArithmeticEnv: feedback={feedback!r}; use one of {list(FEEDBACK)}")
        self.question, self.feedback = (int(a), op, int(b)), feedback
        return EnvReset(prompt=[{"role": "user", "content": f"What is {a} {op} {b}? Answer with the number only."}])

    def step(self, turn: AssistantTurn) -> EnvStep:
        """Returns the end of the episode with its reward for a correct answer or the last failed attempt, else the
        retry message."""
        self.attempts += 1
        value = parse_answer(turn.text, self.question)
        metrics = {"valid_action": float(value is not None)}
        if value == self.answer:
            reward = REWARD_FIRST_ATTEMPT if self.attempts == 1 else REWARD_LATER_ATTEMPT
            return EnvStep(reward=reward, done=True, metrics={**metrics, "attempts": float(self.attempts)})
        if self.attempts >= self.max_attempts:
            return EnvStep(reward=0.0, truncated=True, metrics={**metrics, "attempts": float(self.attempts)})
        return EnvStep(observations=[{"role": "user", "content": self._retry_message(value)}], metrics=metrics)

    def _retry_message(self, value: int | None) -> str:
        """Returns the user message after a wrong attempt: the retry message, or with ``feedback="direction"`` whether
        the answer is higher or lower than ``value`` (an invalid attempt is told to reply with a number)."""
        if self.feedback == "retry":
            return RETRY_MESSAGE
        if value is None:
            return "Wrong: reply with a number. Try again."
        return f"Wrong: the answer is {'higher' if self.answer > value else 'lower'} than {value}. Try again."
