"""GuessNumberEnv: a text-protocol guessing game with higher/lower feedback.

Row columns: ``secret``, ``low``, ``high`` (the secret lies in [low, high]) and ``max_guesses`` (turns allowed).

Protocol: the model's guess is the *first* integer in its turn (``"50"``, ``"I guess 50"``; ``-3`` counts its sign).
The environment answers with one user message: ``"higher"`` (the secret is above the guess), ``"lower"`` or
``"correct"``. A turn without an integer is an invalid action: it is answered with a reminder of the protocol,
counted in ``metrics["invalid_actions"]``, and uses up a turn like a guess (so an episode has at most
``max_guesses`` turns).

Reward, given on the last turn only (None before): success on turn k (1-based, invalid turns included) earns
``max(0, 1.0 - 0.1 * (k - 1))`` (1.0 at once, 0.9 on the second turn, ...); running out of turns earns 0.0 and
ends the episode as truncated (``done=False, truncated=True``); success ends it as done.
"""

from __future__ import annotations

import re
from typing import Any

from rlray.envs.base import AssistantTurn, EnvReset, EnvStep

PENALTY_PER_EXTRA_GUESS = 0.1
_INTEGER = re.compile(r"-?\d+")


def first_integer(text: str) -> int | None:
    """Returns the first integer in ``text`` (a leading minus sign included), or None when there is none."""
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


def success_reward(turns: int) -> float:
    """Returns the reward of a success on turn ``turns`` (1-based): ``max(0, 1 - 0.1 * (turns - 1))``."""
    return max(0.0, round(1.0 - PENALTY_PER_EXTRA_GUESS * (turns - 1), 10))


class GuessNumberEnv:
    """Guess the row's secret number from higher/lower feedback (protocol and reward in the module docstring)."""

    def reset(self, *, secret: int, low: int, high: int, max_guesses: int, **row: Any) -> EnvReset:
        """Returns one user message stating the range, the number of guesses and the answer format.

        Raises:
            ValueError: ``secret`` is outside [low, high] or ``max_guesses`` < 1.
        """
        if not low <= secret <= high or max_guesses < 1:
            raise ValueError(f"GuessNumberEnv: need low <= secret <= high and max_guesses >= 1, got {low=} {secret=} {high=} {max_guesses=}")
        self.secret, self.low, self.high, self.max_guesses = int(secret), int(low), int(high), int(max_guesses)
        self.turns = 0
        text = (
            f"I am thinking of a whole number between {low} and {high}. You have {max_guesses} guesses. "
            "After each guess I answer higher, lower or correct. Answer with your guess as a number only."
        )
        return EnvReset(prompt=[{"role": "user", "content": text}])

    def step(self, turn: AssistantTurn) -> EnvStep:
        """Returns the feedback for one guess, with the reward and done/truncated on the episode's last turn."""
        self.turns += 1
        guess = first_integer(turn.text)
        out_of_turns = self.turns >= self.max_guesses
        if guess is None:
            feedback = f"Invalid answer: reply with a whole number between {self.low} and {self.high}."
        elif guess == self.secret:
            return EnvStep(
                observations=[{"role": "user", "content": "correct"}],
                reward=success_reward(self.turns),
                done=True,
                metrics={"invalid_actions": 0.0, "guesses": float(self.turns)},
            )
        else:
            feedback = "higher" if self.secret > guess else "lower"
        metrics = {"invalid_actions": float(guess is None)}
        if out_of_turns:
            metrics["guesses"] = float(self.turns)
        return EnvStep(
            observations=[{"role": "user", "content": feedback}],
            reward=0.0 if out_of_turns else None,
            truncated=out_of_turns,
            metrics=metrics,
        )
