"""Built-in environments: a calculator tool environment and two text-protocol games (their rows: rlray.data.generate)."""

from rlray.envs.builtin.calculator import CalculatorEnv, calculate
from rlray.envs.builtin.guess import GuessNumberEnv
from rlray.envs.builtin.retry_arith import RetryArithmeticEnv

__all__ = ["CalculatorEnv", "GuessNumberEnv", "RetryArithmeticEnv", "calculate"]
