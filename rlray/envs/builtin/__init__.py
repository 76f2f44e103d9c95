"""Built-in environments: a calculator tool environment and two text-protocol games, with their row generator."""

from rlray.envs.builtin.calculator import CalculatorEnv, calculate
from rlray.envs.builtin.generate import build_rows, write_rows
from rlray.envs.builtin.guess import GuessNumberEnv
from rlray.envs.builtin.retry_arith import RetryArithmeticEnv

__all__ = ["CalculatorEnv", "GuessNumberEnv", "RetryArithmeticEnv", "build_rows", "calculate", "write_rows"]
