"""``rlray judge check``'s numbers: Cohen's kappa, agreement, spread and position bias, on hand-computed cases."""

from __future__ import annotations

import math

import pytest

from rlray.reward.judges.stats import JudgeReport, agreement, cohen_kappa, format_report, position_bias, spread


def test_cohen_kappa_by_hand():
    # Cohen (1960)-style 2x2: 20 yes/yes, 5 yes/no, 10 no/yes, 15 no/no (rows: reference, columns: judge), n = 50.
    # p_o = (20 + 15) / 50 = 0.7; reference yes 25/50, judge yes 30/50: p_e = 0.5*0.6 + 0.5*0.4 = 0.5;
    # kappa = (0.7 - 0.5) / (1 - 0.5) = 0.4
    assert cohen_kappa([[15, 10], [5, 20]]) == pytest.approx(0.4, abs=1e-12)
    assert cohen_kappa([[10, 0], [0, 10]]) == 1.0
    assert cohen_kappa([[0, 5], [5, 0]]) == pytest.approx(-1.0)  # always wrong
    assert math.isnan(cohen_kappa([[0, 0], [0, 7]]))  # both sides constant: chance agreement is 1
    assert math.isnan(cohen_kappa([[0, 0], [0, 0]]))


def test_agreement_reads_yes_no_and_leaves_out_missing_values():
    reference = [1.0, 1.0, 0.0, 0.0, None, 1.0, 0.0]
    scores = [8.0, 3.0, 2.0, 6.0, 9.0, math.nan, 5.0]  # judge yes from 5: 5.0 is yes
    a = agreement("gsm8k_correct", reference, scores, judge_threshold=5.0)
    # pairs: (1,8) yes/yes, (1,3) yes/no, (0,2) no/no, (0,6) no/yes, (0,5) no/yes: accuracy 2/5
    assert (a.samples, a.confusion, a.accuracy) == (5, ((1, 2), (1, 1)), pytest.approx(0.4))
    # p_o = 0.4; reference yes 2/5, judge yes 3/5: p_e = 0.4*0.6 + 0.6*0.4 = 0.48; kappa = (0.4-0.48)/0.52
    assert a.kappa == pytest.approx((0.4 - 0.48) / 0.52, abs=1e-12)
    # Pearson: deviations (.6,.6,-.4,-.4,-.4) and (3.2,-1.8,-2.8,1.2,.2): r = 1.4 / sqrt(1.2 * 22.8)
    assert a.pearson_r == pytest.approx(1.4 / math.sqrt(1.2 * 22.8), abs=1e-12)
    # a constant reference: p_o = 1/2, p_e = 1 * 1/2 = 1/2, kappa 0 (no better than chance); both constant: undefined
    assert agreement("x", [0.0, 0.0], [1.0, 9.0], judge_threshold=5.0).kappa == 0.0
    assert math.isnan(agreement("x", [0.0, 0.0], [1.0, 2.0], judge_threshold=5.0).kappa)


def test_spread_and_position_bias():
    s = spread([1.0, 3.0, math.nan, 3.0], groups=[0, 0, 1, 1])
    assert (s.scored, s.mean, s.low, s.high, s.values) == (3, pytest.approx(7 / 3), 1.0, 3.0, ((3.0, 2), (1.0, 1)))
    assert s.group_std_mean == 1.0  # group 0: std of [1, 3]; group 1 has one score
    assert spread([math.nan]).scored == 0
    # group [0, 1, 2] shown as 2, 0, 1 in pass A (so 1, 0, 2 in pass B); the judge adds 1 to whatever it sees first
    members, orders = [[0, 1, 2]], [[2, 0, 1]]
    first = [5.0, 5.0, 6.0]  # sample 2 shown first in A: 5 + 1
    second = [5.0, 6.0, 5.0]  # sample 1 shown first in B
    bias = position_bias(first, second, members, orders)
    # |changes| = 0, 1, 1; first gains: sample 2 first (A) vs last (B): 6 - 5; sample 1 first (B) vs last (A): 6 - 5
    assert (bias.groups, bias.mean_abs_change, bias.first_gain) == (1, pytest.approx(2 / 3), 1.0)


def test_format_report_prints_the_confusion_table():
    a = agreement("gsm8k_correct", [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], judge_threshold=0.5)
    report = JudgeReport("judge", "pointwise", 3, 1, 0, 2.5, spread([1.0, 1.0, 0.0]), [a], None, "Verdict: correct")
    text = format_report(report)
    assert "judge 'judge' (pointwise): 3 responses judged in 2.5 s" in text and "parse failures: 1 (33.3%)" in text
    assert "vs gsm8k_correct: accuracy 0.667, Cohen's kappa 0.400" in text
    assert "      gsm8k_correct no           1          1\n      gsm8k_correct yes          0          1" in text
    assert "position bias: n/a (pointwise" in text and "example output: Verdict: correct" in text
