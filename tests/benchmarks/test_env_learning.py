"""benchmarks/env_learning.py: the McNemar test and the paired difference, on hand-computed cases."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.fixtures.bench import load_bench

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def env_learning():
    yield load_bench("env_learning")


def test_mcnemar_one_sided_hand_computed(env_learning):
    # n = 8 + 2 = 10 changed episodes: P(X >= 8) = (C(10,8) + C(10,9) + C(10,10)) / 2^10 = (45 + 10 + 1) / 1024
    assert env_learning.mcnemar_one_sided(8, 2) == 56 / 1024
    # all 5 changes improved: 1 / 2^5
    assert env_learning.mcnemar_one_sided(5, 0) == 1 / 32
    # none improved: P(X >= 0) = 1; no change at all: 1
    assert env_learning.mcnemar_one_sided(0, 3) == 1.0
    assert env_learning.mcnemar_one_sided(0, 0) == 1.0


def test_mcnemar_one_sided_matches_scipy_binomtest(env_learning):
    stats = pytest.importorskip("scipy.stats")
    for improved, worsened in [(30, 12), (7, 7), (1, 20), (40, 0)]:
        expected = stats.binomtest(improved, improved + worsened, 0.5, alternative="greater").pvalue
        assert env_learning.mcnemar_one_sided(improved, worsened) == pytest.approx(expected, rel=1e-12)


def test_paired_difference_hand_computed(env_learning):
    # diffs 1, 1, 0, 0: mean 0.5; sample variance (4 * 0.25) / 3 = 1/3; SE = sqrt(1/3) / sqrt(4)
    diff, se = env_learning.paired_difference([0, 0, 0, 1], [1, 1, 0, 1])
    assert diff == 0.5
    assert se == pytest.approx(math.sqrt(1 / 3) / 2, abs=1e-12)
    # diffs 1, 0, 0, -1: mean 0; sample variance 2/3
    diff, se = env_learning.paired_difference([0, 0, 1, 1], [1, 0, 1, 0])
    assert diff == 0.0
    assert se == pytest.approx(math.sqrt(2 / 3) / 2, abs=1e-12)


def test_calibration_source_is_the_heldout_source_with_split_calibration(env_learning):
    heldout = "reasoning-gym:chain_sum?size=200&seed=0&split=heldout&min_terms=2"
    assert env_learning.calibration_source([heldout]) == "reasoning-gym:chain_sum?size=200&seed=0&split=calibration&min_terms=2"
    assert env_learning.calibration_source(["data/retry-arith/heldout.jsonl"]) == env_learning.CALIBRATION_FILE
    assert env_learning.calibration_source([]) == env_learning.CALIBRATION_FILE


def test_scored_record_succeeds_at_full_marks_only(env_learning):
    # single-turn rows: the total reward decides; partial credit (0.5) and NaN / None (a failed or skipped term) fail
    row = type("Row", (), {"prompt_id": "rg:chain_sum:heldout:0:7"})()
    completion = type("C", (), {"finish_reason": "stop"})()
    values = {"reward": [1.0, 0.5, float("nan"), None]}
    records = [env_learning._scored_record(row, completion, "84", values, i) for i in range(4)]
    assert [r["success"] for r in records] == [1, 0, 0, 0]
    assert [r["env_reward"] for r in records] == [1.0, 0.5, 0.0, 0.0]
    assert [r["valid_turns"] for r in records] == [1.0, 1.0, 0.0, 0.0]
    assert records[0] == {"id": "rg:chain_sum:heldout:0:7", "success": 1, "env_reward": 1.0, "turns": 1, "failed": False,
                          "valid_turns": 1.0, "stop_reason": "stop", "text": "84"}


def test_task_flag_picks_the_config(env_learning):
    assert env_learning.TASKS == {"retry-arith": "configs/envs/retry_arith_smollm2.yaml",
                                  "rgym": "configs/grpo_rgym_learn_smollm2.yaml"}
    assert (BENCH.parent / env_learning.TASKS["rgym"]).exists()
