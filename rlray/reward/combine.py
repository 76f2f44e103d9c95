"""The reward total: one rule that sums a sample's weighted terms, whichever stage they come from.

A sample's reward comes in up to three stages, each adding its named terms to the previous stage's values:

1. the reward functions and the reward model (``RewardScorer``, in the reward application or in-process);
2. the judges (``rlray.reward.judges.panel.JudgePanel``, on rank 0);
3. the environment's reward of an episode, the term "env" (``rlray.run.episodes.add_env_reward``).

Each stage calls ``combine``. A term's value is a float, None (*skipped*: the term does not apply to the sample) or
NaN (*failed*). Per sample, ``reward = sum of weight * value`` over the terms that apply, summed in Python floats
from 0.0 in order (stage by stage; within a stage, in the order given), so the stages together give exactly the sum
over all terms. A failed value makes the reward NaN. A sample no term applied to is NaN, nothing rewarded it,
except when there are no terms at all (0.0: the task reward is off); a later stage whose terms do not apply leaves
a sample's reward as it was, and one whose terms apply starts from 0.0 when no earlier term applied.

The result is ``{"reward": [B], <term name>: [B], ...}``: "reward" first, then the terms in the order they were
added; the loop logs each as ``reward/<name>`` (``rlray.run.experience``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Term:
    """One named, weighted reward term over B samples.

    Attributes:
        name: the term's name (metric ``reward/<name>``; a key of the combined values).
        weight: its weight in the total.
        values: B values: a float, None (skipped) or NaN (failed).
    """

    name: str
    weight: float
    values: Sequence[float | None]


def combine(terms: Sequence[Term], size: int,
            prior: Mapping[str, Sequence[float | None]] | None = None) -> dict[str, list]:  # fmt: skip
    """Returns the values of B = ``size`` samples with ``terms`` added to their reward (module docstring).

    Args:
        terms: the stage's terms, in the order they are summed.
        size: B.
        prior: the previous stage's values ({"reward": [B], <term>: [B], ...}), or None for the first stage.

    Raises:
        ValueError: a term's values are not B long.
    """
    if bad := [t.name for t in terms if len(t.values) != size]:
        raise ValueError(f"combine: the values of terms {bad} are not {size} long")
    earlier = [k for k in prior if k != "reward"] if prior is not None else []
    reward = []
    for i in range(size):
        applied_before = any(prior[k][i] is not None for k in earlier)
        total, applied = (prior["reward"][i] if applied_before else 0.0), False
        for term in terms:
            value = term.values[i]
            if value is not None:
                total += term.weight * value
                applied = True
        if applied or applied_before:
            reward.append(total)
        elif prior is not None:
            reward.append(prior["reward"][i])
        else:
            reward.append(math.nan if terms else 0.0)
    out: dict[str, list] = {"reward": reward} if prior is None else dict(prior)
    out.update({t.name: list(t.values) for t in terms})
    out["reward"] = reward
    return out
