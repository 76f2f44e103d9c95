"""Samples kept per step: which rows (deterministic, spread over the groups) and their JSON encodings."""

from __future__ import annotations

import json
import math

from rlray.observe.samples import StepSample, json_row, pick_rows, table_columns


def test_pick_rows_spreads_over_groups_and_repeats():
    groups = [g for g in range(8) for _ in range(4)]  # P=8 prompts, G=4 samples each
    rows = pick_rows(groups, 4, seed=0, step=1)
    assert rows == sorted(rows) and len(set(rows)) == 4
    assert len({groups[r] for r in rows}) == 4  # one per group while there are more groups than rows
    assert pick_rows(groups, 4, seed=0, step=1) == rows  # seeded by (seed, step)
    assert pick_rows(groups, 4, seed=0, step=2) != rows or pick_rows(groups, 4, seed=1, step=1) != rows
    many = pick_rows(groups, 12, seed=3, step=5)  # more rows than groups: every group gives one, then a second
    assert len(set(many)) == 12 and all(sum(groups[r] == g for r in many) in (1, 2) for g in range(8))
    assert pick_rows(groups, 100, seed=0, step=1) == list(range(32))
    assert pick_rows(groups, 0, seed=0, step=1) == []


def test_json_row_has_no_nan_and_keeps_failed_apart_from_skipped():
    s = StepSample(2, "p", "q", "<script>alert(1)</script>", math.nan, {"a": math.nan, "b": None, "c": 0.5}, math.nan,
                   "length", 1, 3)
    row = json_row(s)
    assert row["reward"] is None and row["advantage"] is None
    assert row["terms"] == {"a": "failed", "b": None, "c": 0.5}
    text = json.dumps(row, allow_nan=False)  # valid JSON for a browser's JSON.parse
    assert "<script>alert(1)</script>" in json.loads(text)["completion"]  # kept as data; the page shows it as text
    cols = table_columns([s, StepSample(2, "p2", "q", "ok", 1.0, {"c": 1.0}, 0.25, "stop", 1, 2)])
    assert cols["reward/a"] == ["failed", None] and cols["reward/c"] == [0.5, 1.0] and cols["advantage"] == [None, 0.25]
    assert table_columns([]) == {}


def test_mask_runs():
    from rlray.observe.samples import mask_runs

    assert mask_runs([True, True, False, False, False, True]) == [(0, 2, True), (2, 5, False), (5, 6, True)]
    assert mask_runs([False]) == [(0, 1, False)] and mask_runs([]) == []



def test_value_runs():
    from rlray.observe.samples import value_runs

    assert value_runs([0, 0, 1, 2, 2]) == [(0, 2, 0), (2, 3, 1), (3, 5, 2)]
    assert value_runs([3, 1, 3]) == [(0, 1, 3), (1, 2, 1), (2, 3, 3)] and value_runs([]) == []


def test_episode_fields_survive_the_mlflow_table_and_old_tables_stay_readable(tmp_path):
    """A kept episode goes to MLflow and back unchanged (segments nested); a table an older rlray wrote (without the
    episode columns) reads back without them."""


    from rlray.observe.samples import StepSample, json_row, rows_from_table
    from rlray.observe.tracking import Tracker, read_artifact_json

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "episodes")
    episode = StepSample(2, "p", "<user>guess", "<a>5</a><obs>higher</obs><a>7</a>", 1.0, {"env": 1.0}, 0.5, "stop", 1, 9,
                         "done", 2, (None, 1.0), ((True, "<a>5</a>"), (False, "<obs>higher</obs>"), (True, "<a>7</a>")))
    single = StepSample(2, "q", "2+2?", "4</s>", 0.0, {"env": 0.0}, -0.5, "stop", 0, 2,
                        version_parts=((0, 1, "4"), (1, 1, "</s>")))  # a partial rollout: one token each of v0, v1
    tracker.log_samples([episode, single], step=2)
    tracker.flush()
    rows = rows_from_table(read_artifact_json(uri, tracker.run_id, "samples/step_000002.json"))
    assert rows == [json_row(episode), json_row(single)]
    assert rows[0]["segments"][1] == {"role": "observation", "text": "<obs>higher</obs>"} and rows[0]["turn_rewards"] == [None, 1.0]
    assert rows[1]["segments"] == [] and rows[1]["num_turns"] is None and rows[0]["version_parts"] == []
    assert rows[1]["version_parts"] == [{"version": 0, "tokens": 1, "text": "4"}, {"version": 1, "tokens": 1, "text": "</s>"}]
    old = {"columns": ["step", "prompt_id", "prompt", "completion", "reward", "advantage", "finish_reason",
                       "policy_version", "response_tokens", "reward/env"], "data": [[2, "p", "q", "c", 1.0, 0.5, "stop", 1, 3, 1.0]]}
    assert rows_from_table(old) == [{"step": 2, "prompt_id": "p", "prompt": "q", "completion": "c", "reward": 1.0, "advantage": 0.5,
                                     "finish_reason": "stop", "policy_version": 1, "response_tokens": 3, "terms": {"env": 1.0},
                                     "judge_outputs": {}}]
    tracker.finish()


def test_a_segment_of_a_cut_agent_episode_is_kept_by_number():
    cut = StepSample(3, "w", "q", "a", 1.0, {"env": 1.0}, 0.5, "stop", 2, 4, "template_drift", 1, (None,),
                     ((True, "a"),), segment=0)
    assert json_row(cut)["segment"] == 0 and table_columns([cut])["segment"] == [0]
    assert json_row(StepSample(3, "p", "q", "a", 1.0, {}, 0.5, "stop", 2, 4))["segment"] is None


def test_judge_outputs_go_to_their_own_columns_and_back():
    """Each judge's raw output on a kept sample is a column judge/<name> of the MLflow table, and reads back nested; a
    sample without a judge's output has null there, and reads back without it."""
    from rlray.observe.samples import rows_from_table

    judged = StepSample(3, "p", "2+2?", "4", 1.5, {"gsm8k_correct": 1.0, "judge": 0.5}, 0.1, "stop", 2, 1,
                        judge_outputs={"judge": "Verdict: correct [p: correct 0.500, wrong 0.500]", "rank": "Response 1: 7"})
    plain = StepSample(3, "q", "3+3?", "7", 0.0, {"gsm8k_correct": 0.0}, -0.1, "stop", 2, 1)
    row = json_row(judged)
    assert row["judge_outputs"] == {"judge": "Verdict: correct [p: correct 0.500, wrong 0.500]", "rank": "Response 1: 7"}
    cols = table_columns([judged, plain])
    assert cols["judge/judge"] == ["Verdict: correct [p: correct 0.500, wrong 0.500]", None]
    assert cols["judge/rank"] == ["Response 1: 7", None] and "judge_outputs" not in cols
    split = {"columns": list(cols), "data": [list(v) for v in zip(*cols.values(), strict=True)]}
    back = rows_from_table(split)
    assert back[0]["judge_outputs"] == row["judge_outputs"] and back[1]["judge_outputs"] == {}
    assert back[0] == json_row(judged)  # (the plain row reads back with a null "judge" term: skipped or lacking, as documented)
