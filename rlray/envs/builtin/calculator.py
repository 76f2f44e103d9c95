"""CalculatorEnv: word problems solved with a ``calculator`` tool (native tool calling), graded on the last number.

Rows: a GSM8K row (``question``, and ``answer`` holding the solution ending in ``#### <number>``) or a generated
problem (``question``, and ``answer`` holding the number itself). The model may call ``calculator(expression)``
any number of times; its first turn without a tool call ends the episode and is graded: reward 1.0 when the last
number in that turn (thousands commas dropped) equals the reference number, else 0.0.

The calculator evaluates ``+ - * /``, unary minus, parentheses and decimal numbers by walking Python's ``ast``
with a whitelist (no ``eval``), in exact rational arithmetic (``fractions.Fraction``), so ``0.1 + 0.2`` is ``0.3``.

Grading: ``rlray.reward`` cannot be imported from ``rlray.envs`` (tests/test_architecture.py), so the GSM8K rule
is restated here in its simple numeric form: the reference is the text after the last ``####`` (GSM8K's answer
convention, Cobbe et al. 2021), numbers compared as exact fractions.
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction
from typing import Any

from rlray.envs.base import AssistantTurn, EnvReset
from rlray.envs.toolenv import ToolEnvironment

MAX_EXPRESSION_CHARS = 200
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_BINARY = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__, ast.Div: Fraction.__truediv__}
INSTRUCTION = (
    "Solve the problem. You can call the calculator tool for arithmetic. When you are done, answer without a tool "
    "call and end with the final answer as a number."
)


def _evaluate(node: ast.AST) -> Fraction:
    """Returns the exact value of a whitelisted expression node.

    Raises:
        ValueError: any node outside numbers, + - * /, unary + -; or a division by zero.
    """
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"unsupported element {type(node).__name__}; use numbers, + - * / and parentheses")


def format_number(value: Fraction) -> str:
    """Returns ``value`` as text: an integer exactly (``"12"``), else a decimal to 12 significant digits (``"3.5"``)."""
    if value.denominator == 1:
        return str(value.numerator)
    return format(float(value), ".12g")


def calculate(expression: str) -> str:
    """Returns the value of an arithmetic expression as text (``"2 * (3 + 4)"`` gives ``"14"``, ``"7/2"`` ``"3.5"``).

    Raises:
        ValueError: the expression is longer than ``MAX_EXPRESSION_CHARS``, is not valid syntax, holds anything but
            numbers, + - * / and parentheses (no names, calls, powers), or divides by zero.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from err
    return format_number(_evaluate(tree))


def last_number(text: str) -> Fraction | None:
    """Returns the last number in ``text`` (commas dropped: ``"1,080"`` is 1080; a trailing period is not a decimal
    point), or None when there is none."""
    matches = _NUMBER.findall(text)
    return Fraction(matches[-1].replace(",", "")) if matches else None


def reference_number(answer: Any) -> Fraction | None:
    """Returns the reference of a row's ``answer``: the number after the last ``####`` of a GSM8K solution, else the
    last number of the value as text; None when there is no number."""
    text = str(answer)
    return last_number(text.rsplit("####", 1)[-1])


class CalculatorEnv(ToolEnvironment):
    """Word problems with a calculator tool; reward 1.0 when the final turn's last number is the answer (module doc)."""

    def reset(self, *, question: str, answer: Any, **row: Any) -> EnvReset:
        """Returns one user message (the question and ``INSTRUCTION``) and the ``calculator`` tool.

        Raises:
            ValueError: ``answer`` holds no number.
        """
        self.reference = reference_number(answer)
        if self.reference is None:
            raise ValueError(f"CalculatorEnv: the row's answer {str(answer)[-80:]!r} holds no number")
        return self.begin([{"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}], tools=[self.calculator])

    def calculator(self, expression: str) -> str:
        """Evaluates an arithmetic expression with +, -, *, / and parentheses.

        Args:
            expression: The expression to evaluate, for example "(12 + 3) * 4 / 5".
        """
        return calculate(expression)

    def final_reward(self, turn: AssistantTurn) -> float:
        """Returns 1.0 when the last number of the final turn equals the row's answer, else 0.0."""
        return 1.0 if last_number(turn.text) == self.reference else 0.0
