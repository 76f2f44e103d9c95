"""How sane a judge is, from its scores on a few rows (``rlray judge check``): agreement with a reference (a
verifier's values or a labelled column), the spread of its scores, its parse failures, and its position bias.

Agreement is on a yes/no reading of both sides: a reference value above ``reference_threshold`` (0: a verifier's
1/0 is yes/no) and a judge score at or above ``judge_threshold`` (default: the middle of the judge's scale) are
"yes". On the samples where both have a value: accuracy, Cohen's kappa (``cohen_kappa``: agreement beyond chance)
and the confusion table, plus Pearson's r of the raw values.

Position bias (a mode that shows a group together, ``JudgeMode.together``: group mode): every group is judged twice,
in a drawn order and in its reverse; reported are the mean absolute change of a sample's score between the two, and
the mean gain of a sample shown first over the same sample shown last (positive: the judge favours the first
response; Zheng et al. 2023, "Judging LLM-as-a-judge", Sec. 3.3).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rlray.reward.judges.modes import judge_mode


def cohen_kappa(confusion: Sequence[Sequence[int]]) -> float:
    """Returns Cohen's kappa of a square confusion table (rows: reference classes, columns: the judge's).

    kappa = (p_o - p_e) / (1 - p_e), p_o the share on the diagonal and p_e the agreement expected by chance from
    the two marginals (Cohen 1960, eq. 1). NaN when p_e is 1 (both sides give one class only) or the table is empty.
    """
    table = np.asarray(confusion, dtype=np.float64)
    n = table.sum()
    if n == 0:
        return math.nan
    p_o = np.trace(table) / n
    p_e = float((table.sum(axis=1) * table.sum(axis=0)).sum() / n**2)
    return math.nan if p_e >= 1.0 else float((p_o - p_e) / (1.0 - p_e))


@dataclass(frozen=True)
class Agreement:
    """A judge against one reference.

    Attributes:
        reference: the reference's name (a reward.functions term, or a column).
        samples: samples where both the judge and the reference have a value.
        accuracy: share of those on which the yes/no readings agree.
        kappa: Cohen's kappa of the yes/no readings (NaN when both sides are constant and agree by chance alone).
        confusion: [[no/no, no/yes], [yes/no, yes/yes]]: rows the reference, columns the judge.
        pearson_r: correlation of the raw values (NaN when either side is constant).
    """

    reference: str
    samples: int
    accuracy: float
    kappa: float
    confusion: tuple[tuple[int, int], tuple[int, int]]
    pearson_r: float


def agreement(name: str, reference: Sequence[float | None], scores: Sequence[float], *, judge_threshold: float,
              reference_threshold: float = 0.0) -> Agreement:  # fmt: skip
    """Returns the ``Agreement`` of judge ``scores`` with ``reference`` values (None or NaN: no value; left out)."""
    pairs = [(float(r), float(s)) for r, s in zip(reference, scores, strict=True)
             if r is not None and math.isfinite(r) and math.isfinite(s)]  # fmt: skip
    confusion = [[0, 0], [0, 0]]
    for r, s in pairs:
        confusion[int(r > reference_threshold)][int(s >= judge_threshold)] += 1
    n = len(pairs)
    ref, judge = np.asarray([p[0] for p in pairs]), np.asarray([p[1] for p in pairs])
    r = float(np.corrcoef(ref, judge)[0, 1]) if n > 1 and ref.std() > 0 and judge.std() > 0 else math.nan
    accuracy = (confusion[0][0] + confusion[1][1]) / n if n else math.nan
    return Agreement(name, n, accuracy, cohen_kappa(confusion), (tuple(confusion[0]), tuple(confusion[1])), r)


@dataclass(frozen=True)
class Spread:
    """How a judge's scores spread over the samples that got one.

    Attributes:
        scored: samples with a score; mean, std, low, high: over them (NaN when none).
        values: the most frequent scores (rounded to 3 decimals) and their counts, most frequent first (at most 8).
        group_std_mean: mean over groups of the scores' standard deviation within a group (NaN without groups of 2+).
    """

    scored: int
    mean: float
    std: float
    low: float
    high: float
    values: tuple[tuple[float, int], ...] = ()
    group_std_mean: float = math.nan


def spread(scores: Sequence[float], groups: Sequence[int] | None = None) -> Spread:
    """Returns the ``Spread`` of ``scores`` (NaN: failed, left out); ``groups``: each sample's group id."""
    ok = np.asarray([s for s in scores if math.isfinite(s)], dtype=np.float64)
    counts = Counter(round(float(s), 3) for s in ok).most_common(8)
    within = []
    if groups is not None:
        by_group: dict[int, list[float]] = {}
        for s, g in zip(scores, groups, strict=True):
            if math.isfinite(s):
                by_group.setdefault(g, []).append(s)
        within = [float(np.std(v)) for v in by_group.values() if len(v) > 1]
    if not ok.size:
        return Spread(0, math.nan, math.nan, math.nan, math.nan)
    return Spread(int(ok.size), float(ok.mean()), float(ok.std()), float(ok.min()), float(ok.max()), tuple(counts),
                  float(np.mean(within)) if within else math.nan)  # fmt: skip


@dataclass(frozen=True)
class PositionBias:
    """A group-mode judge's scores of the same groups in two orders (the drawn one and its reverse).

    Attributes:
        groups: groups of 2+ samples compared.
        mean_abs_change: mean over samples scored both times of |score in order A - score in order B|.
        first_gain: mean over groups of the score a sample gets when shown first minus when shown last (both the
            sample first in A, last in B, and the sample last in A, first in B count).
    """

    groups: int
    mean_abs_change: float
    first_gain: float


def position_bias(first: Sequence[float], second: Sequence[float], members: Sequence[Sequence[int]],
                  orders: Sequence[Sequence[int]]) -> PositionBias:  # fmt: skip
    """Returns the ``PositionBias`` of two passes over the same groups.

    Args:
        first, second: B scores of the pass in the drawn orders, and of the pass in the reversed orders.
        members: each group's sample indices (batch order).
        orders: each group's drawn order (``orders[g][k]``: the member shown k-th in the first pass).
    """
    changes = [abs(a - b) for a, b in zip(first, second, strict=True) if math.isfinite(a) and math.isfinite(b)]
    gains = []
    for m, order in zip(members, orders, strict=True):
        if len(m) < 2:
            continue
        shown_first, shown_last = m[order[0]], m[order[-1]]  # first in pass 1 (so last in pass 2), and the reverse
        for a, b in ((first[shown_first], second[shown_first]), (second[shown_last], first[shown_last])):
            if math.isfinite(a) and math.isfinite(b):
                gains.append(a - b)
    groups = sum(len(m) > 1 for m in members)
    return PositionBias(groups, float(np.mean(changes)) if changes else math.nan, float(np.mean(gains)) if gains else math.nan)


@dataclass
class JudgeReport:
    """What ``rlray judge check`` found for one judge.

    Attributes:
        name, mode: the judge's.
        samples: responses judged; parse_failures, errors: of them (failed scores).
        seconds: wall time of judging them (the first pass).
        spread: the scores' ``Spread``.
        agreements: one ``Agreement`` per reference.
        position: the ``PositionBias`` (a mode that shows groups together), else None.
        example: one raw judge output, for people to read.
    """

    name: str
    mode: str
    samples: int
    parse_failures: int
    errors: int
    seconds: float
    spread: Spread
    agreements: list[Agreement] = field(default_factory=list)
    position: PositionBias | None = None
    example: str = ""


def _num(x: float, fmt: str = "{:.3f}") -> str:
    return "n/a" if x is None or not math.isfinite(x) else fmt.format(x)


def format_report(report: JudgeReport) -> str:
    """Returns ``report`` as text lines for people: parse failures, spread, agreements with confusion tables, bias."""
    s = report.spread
    lines = [
        f"judge '{report.name}' ({report.mode}): {report.samples} responses judged in {report.seconds:.1f} s",
        f"  parse failures: {report.parse_failures} ({_num(report.parse_failures / max(report.samples, 1), '{:.1%}')}), "
        f"other failures: {report.errors}",
        f"  scores: mean {_num(s.mean)}, std {_num(s.std)}, range [{_num(s.low)}, {_num(s.high)}] over {s.scored}; "
        "most frequent: " + (", ".join(f"{v:g} x{c}" for v, c in s.values) or "none"),
    ]
    if math.isfinite(s.group_std_mean):
        lines.append(f"  within a group: mean std {_num(s.group_std_mean)}")
    for a in report.agreements:
        (nn, ny), (yn, yy) = a.confusion
        w = len(a.reference) + 5
        lines += [
            f"  vs {a.reference}: accuracy {_num(a.accuracy)}, Cohen's kappa {_num(a.kappa)}, Pearson r "
            f"{_num(a.pearson_r)} over {a.samples}",
            f"      {'':<{w}}{'judge no':>10}{'judge yes':>11}",
            f"      {a.reference + ' no':<{w}}{nn:>10}{ny:>11}",
            f"      {a.reference + ' yes':<{w}}{yn:>10}{yy:>11}",
        ]
    if report.position is not None:
        p = report.position
        lines.append(f"  position bias over {p.groups} groups judged in two orders: mean |change| {_num(p.mean_abs_change)}, "
                     f"shown first vs last {_num(p.first_gain, '{:+.3f}')}")
    elif not judge_mode(report.mode).together:
        lines.append(f"  position bias: n/a ({report.mode}: one response per call)")
    if report.example:
        lines.append("  example output: " + report.example.replace("\n", " | ")[:300])
    return "\n".join(lines)
