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
