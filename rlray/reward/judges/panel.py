"""``JudgePanel``: every judge of a run, scoring a batch at once and adding its terms to the reward stage's scores.

Built by ``rlray.run.build.judge_panel`` from ``reward.judges`` (rank 0 of a run, ``rlray eval``); the online step calls
``score`` after the scorer (``rlray.run.experience.score``) and ``take_metrics`` once per step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlray.reward.combine import Term, combine
from rlray.reward.judges.client import JudgeClient, JudgeScores, JudgeStats
from rlray.reward.server import ScoreResult

METRIC_PREFIX = "reward/judge_"


@dataclass
class JudgeTerm:
    """One judge as a reward term: its name (metric ``reward/<name>``), its weight and its client."""

    name: str
    weight: float
    client: JudgeClient


def add_judge_terms(values: dict[str, list[float | None]], judged: Sequence[tuple[str, float, list[float]]]) -> dict[str, list]:
    """Returns the scorer's values with each judge added as a term, in order (``rlray.reward.combine``).

    ``reward[i] = base[i] + sum of weight * score[i]`` over the judges, where base is the scorer's reward, or 0.0
    when every scorer term skipped the sample (None; a scorer without terms gives 0.0 already), so a judge alone
    rewards it. A failed judge score (NaN) makes the reward NaN, as a failed reward function does.

    Args:
        values: ``RewardScorer.score``'s result: {"reward": [B], <term>: [B]}.
        judged: (name, weight, B scores) per judge.
    """
    return combine([Term(name, weight, scores) for name, weight, scores in judged], len(values["reward"]), prior=values)


class JudgePanel:
    """The run's judges (``JudgeTerm``), called concurrently on each batch.

    Args:
        terms: the judges, in ``reward.judges`` order.
        source: the ``reward.judges`` entries it was built from, as dicts (a rollback compares them).
    """

    def __init__(self, terms: Sequence[JudgeTerm], source: list[dict] | None = None) -> None:
        self.terms = list(terms)
        self.source = list(source or [])
        self._pool = ThreadPoolExecutor(max_workers=max(len(self.terms), 1), thread_name_prefix="judges")

    @property
    def names(self) -> list[str]:
        """Returns the judges' term names."""
        return [t.name for t in self.terms]

    def score(self, result: ScoreResult, prompts: Sequence[str | list[dict]], responses: Sequence[str],
              columns: Sequence[dict[str, Any]], groups: Sequence[int] | None = None, seed: int = 0) -> ScoreResult:  # fmt: skip
        """Returns ``result`` with every judge's term added (``add_judge_terms``) and their raw outputs in
        ``ScoreResult.outputs`` ({judge name: B outputs}).

        Args:
            result: the scorer's result for the B samples.
            prompts, responses, columns: the B samples (``JudgeClient.score``).
            groups: the B samples' group ids (group-mode judges judge each group together).
            seed: seeds the order groups are shown in; judge k uses ``seed * 1009 + k``.
        """
        futures = [self._pool.submit(t.client.score, prompts, responses, columns, groups, seed * 1009 + k)
                   for k, t in enumerate(self.terms)]  # fmt: skip
        got: list[JudgeScores] = [f.result() for f in futures]
        values = add_judge_terms(result.values, [(t.name, t.weight, g.scores) for t, g in zip(self.terms, got, strict=True)])
        outputs = {**result.outputs, **{t.name: list(g.outputs) for t, g in zip(self.terms, got, strict=True)}}
        failures = list(result.failures) or [""] * len(responses)
        for t, g in zip(self.terms, got, strict=True):  # a judge's failed verdict names the judge (rlray.run.failures)
            for i, score in enumerate(g.scores):
                if not failures[i] and score is not None and math.isnan(score):
                    shown = g.outputs[i][:200] if g.outputs[i] else "no output (the judge did not answer)"
                    failures[i] = f"judge '{t.name}': no score in its output: {shown!r}"
        return dataclasses.replace(result, values=values, outputs=outputs, failures=failures)

    def take_metrics(self) -> dict[str, float]:
        """Returns the ``reward/judge_*`` metrics of every call since the last time, all judges together (module
        docstring of ``rlray.reward.judges.client``); latency and version only when a judge answered."""
        stats = [t.client.take_stats() for t in self.terms]
        total = JudgeStats()
        for s in stats:
            for f in dataclasses.fields(JudgeStats):
                if f.name != "version":
                    setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
        out = {METRIC_PREFIX + k: float(getattr(total, k)) for k in
               ("requests", "cache_hits", "calls", "retries", "parse_failures", "errors", "prompt_tokens", "output_tokens")}
        if total.calls:
            out[METRIC_PREFIX + "latency_s"] = total.call_s / total.calls
        versions = [s.version for s in stats if s.version is not None]
        if versions:
            out[METRIC_PREFIX + "version"] = float(min(versions))
        return out

    def close(self) -> None:
        """Stops the judges' client threads."""
        for t in self.terms:
            t.client.close()
        self._pool.shutdown(wait=False)

