"""The environment of ``benchmarks/env_vs_trl.py``, in TRL 1.16's ``environment_factory`` shape, run unchanged by
TRL's GRPOTrainer and by rlray (``env.environments={multiply: 'benchmarks/multiply_env.py:MultiplyEnv'}``, wrapped
by ``rlray.envs.trl``).

An episode: "What is 37 x 45?"; ``reset`` appends a hint to use the tool; the model may call ``multiply`` (a Hermes
``<tool_call>`` block under the ``smollm2-tools`` chat template) and sees the product as the tool's result; the
episode ends on the first turn without a tool call. ``get_reward`` is 1.0 when ``multiply`` was called with the
row's factors, else 0.0 (TRL's environment shape never sees the final text, so the tool call is what is scored).
"""

from __future__ import annotations

import json
import random
from pathlib import Path


class MultiplyEnv:
    """Multiplies on request; remembers whether the row's factors were multiplied."""

    def __init__(self) -> None:
        self.a = self.b = 0
        self.called = False

    def reset(self, **row) -> str:
        """Starts an episode from a dataset row (columns ``a`` and ``b``); returns the hint appended to the prompt."""
        self.a, self.b = int(row["a"]), int(row["b"])
        self.called = False
        return f" Use the multiply tool on {self.a} and {self.b}, then give the product."

    def multiply(self, a: int, b: int) -> int:
        """Multiplies two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        if sorted((int(a), int(b))) == sorted((self.a, self.b)):
            self.called = True
        return int(a) * int(b)

    def get_reward(self) -> float:
        """Returns 1.0 when ``multiply`` was called with the row's factors, else 0.0."""
        return 1.0 if self.called else 0.0


def rows(count: int, seed: int = 0) -> list[dict]:
    """Returns ``count`` seeded questions {"prompt", "environment", "a", "b"} with two-digit factors."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({"prompt": f"What is {a} x {b}?", "environment": "multiply", "a": a, "b": b})
    return out


def write_rows(path: str | Path, count: int, seed: int = 0) -> None:
    """Writes ``rows(count, seed)`` to ``path`` as JSON Lines."""
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows(count, seed)))
