"""The pure helpers of the benchmark scripts (benchmarks/benchlib.py, summaries of weight_sync.py and run_all.py)."""

from __future__ import annotations

import pytest

from tests.fixtures.bench import load_bench


@pytest.fixture(scope="module")
def bench():
    """Imports the scripts as the scripts import each other (benchmarks/ on sys.path)."""
    yield {name: load_bench(name) for name in ("benchlib", "weight_sync", "run_all")}


def test_ratio_and_rates(bench):
    b = bench["benchlib"]
    assert b.ratio(3.0, 4.0) == 0.75
    assert b.ratio(None, 4.0) is None and b.ratio(3.0, None) is None and b.ratio(3.0, 0.0) is None
    assert b.per_second([10, 30], [1.0, 3.0]) == 10.0  # 40 tokens over 4 s, not the mean of the rates
    assert b.per_second([5], [0.0]) is None


def test_step_durations_and_median_after_warmup(bench):
    b = bench["benchlib"]
    ends = [10.0, 12.0, 15.0, 16.0, 20.0]  # steps 1..5 end here
    durations = b.step_durations(ends)
    assert durations == [2.0, 3.0, 1.0, 4.0]  # steps 2..5
    assert b.median_after_warmup(durations, warmup=1) == 2.5  # steps 2..5
    assert b.median_after_warmup(durations, warmup=2) == 3.0  # steps 3..5: 3, 1, 4
    assert b.median_after_warmup(durations, warmup=5) is None


def test_markdown_table_formats_cells(bench):
    b = bench["benchlib"]
    text = b.markdown_table(["run", "s", "ratio"], [["a", 1.234, None], ["b", 7, 0.5]])
    assert text.splitlines() == ["| run | s | ratio |", "|---|---|---|", "| a | 1.23 | n/a |", "| b | 7 | 0.50 |"]
    with pytest.raises(ValueError, match="2 cells for 3 headers"):
        b.markdown_table(["a", "b", "c"], [[1, 2]])
    assert b.fmt(2.0, 0) == "2" and b.fmt_percent(0.0153) == "1.5%" and b.fmt_percent(None) == "n/a"


def test_weight_sync_summary(bench):
    raw = {"bytes": 1000, "actors": 2, "seconds": [0.5, 0.1, 0.2], "memcpy_s": [0.01, 0.02, 0.03],
           "put_s": [0.1, 0.05, 0.07], "load_s": [0.4, 0.05, 0.13]}
    out = bench["weight_sync"].summarise(raw)
    assert out["sync_s"] == 0.2 and out["memcpy_s"] == 0.02
    assert out["sync_bytes_per_s"] == pytest.approx(5000.0)
    assert out["memcpy_bytes_per_s"] == pytest.approx(50000.0)
    assert out["sync_vs_memcpy"] == pytest.approx(0.1)
    assert out["delivered_bytes_per_s"] == pytest.approx(10000.0)  # the same bytes reach 2 engines
    assert out["put_median_s"] == 0.07 and out["load_median_s"] == 0.13


def test_run_all_summary_rows_compare_with_targets(bench):
    results = {
        "grpo_vs_trl": {"models": {"m": {"runs": {"trl": {"step_time_vs_trl": 1.0},
                                                  "rlray-sync": {"step_time_vs_trl": 0.5, "peak_pss_vs_trl": 1.3},
                                                  "rlray-async": {"step_time_vs_sync": 1.05}}}}},
        "env_vs_trl": {"runs": {"trl": {"step_time_vs_trl": 1.0}, "rlray-sync": {"step_time_vs_trl": 0.45}}},
        "rollout": {"runs": {"vllm": {"vs_vllm": 1.0}, "rlray": {"vs_vllm": 0.95}}},
        "weight_sync": {"runs": {"object_store x1": {"sync_vs_memcpy": 0.2}, "object_store x2": {"error": "x"}}},
        "experience": {"runs": [{"case": "step", "world": 1, "move_vs_step": 0.01},
                                {"case": "scaled", "world": 1, "move_vs_step": None}]},
        "learner_packing": {"results": [  # (logprobs + update) packed+shared / today: demo 2.0 / 5.0, env 2.0 / 5.0
            {"workload": w, "dtype": "float32", "runs": {"today": {"logprobs_s": 1.0, "update_s": 4.0},
                                                         "packed+shared": {"logprobs_s": 0.5, "update_s": 1.5}}}
            for w in ("demo", "env", "grpo")]},  # grpo's target is the whole step against TRL's: no row here
        "partial_rollouts": {"runs": {"whole": {"step_s": 2.0}, "partial": {"step_s": 1.8, "step_time_vs_whole": 0.9}}},
    }
    rows = bench["run_all"].summary_rows(results)
    assert [(r[1], r[3]) for r in rows] == [(0.5, "yes"), (1.3, "no"), (1.05, "no"), (0.45, "yes"), (0.95, "yes"), (0.2, "no"),
                                            (None, "n/a"), (0.01, "yes"), (0.4, "yes"), (0.4, "no"), (0.9, "yes")]
    assert rows[-2][0] == "learner logprobs + update, env (float32): packed+shared / padded before" and rows[-2][2] == "<= 0.33"
    assert rows[-1][0] == "async step time on long-tailed lengths: rollout.partial / whole generations"
    assert bench["run_all"].summary_rows({}) == []


CHILD_SCRIPT = """
import json, sys
from pathlib import Path
assert sys.argv[1] == "--child"
mode, result = sys.argv[2], Path(sys.argv[3])
print("child says", mode)
if mode == "ok":
    result.write_text(json.dumps({"tokens": [3, 4], "mode": mode}))
elif mode == "no-result":
    pass
else:
    sys.exit(3)
"""


@pytest.mark.parametrize(("mode", "error"), [("ok", None), ("fail", "exit code 3"), ("no-result", "exit code 0")])
def test_run_script_child_merges_the_result_or_names_the_failure(bench, tmp_path, mode, error):
    script = tmp_path / "child.py"
    script.write_text(CHILD_SCRIPT)
    result, log = tmp_path / "result.json", tmp_path / "child.log"
    out = bench["benchlib"].run_script_child(script, [mode, result], result_path=result, log_path=log,
                                             timeout_s=60, label=mode)
    assert out["log"] == str(log) and out["wall_s"] > 0
    if error is None:
        assert out["returncode"] == 0 and out["tokens"] == [3, 4] and out["mode"] == "ok" and "error" not in out
    else:
        assert out["error"] == error and f"child says {mode}" in out["log_tail"] and "tokens" not in out


@pytest.mark.parametrize(("cmdline", "name", "label"), [
    (["ray::RolloutActor.generate"], "python", "ray::RolloutActor"),
    (["ray::IDLE"], "python", "ray::IDLE"),
    (["/venv/lib/python3.12/site-packages/ray/core/src/ray/raylet/raylet", "--node_id=x"], "raylet", "raylet"),
    (["/venv/bin/python", "-u", "/venv/lib/ray/dashboard/dashboard.py", "--host=127.0.0.1"], "python", "dashboard.py"),
    (["/venv/bin/python", "-u", "/venv/lib/ray/dashboard/agent.py"], "python", "dashboard/agent.py"),
    (["ray-dashboard-NodeHead-0 (/venv/bin/python)"], "python", "ray-dashboard-* (modules)"),
    ([], "gcs_server", "gcs_server"),
])
def test_process_label_names_the_role(bench, cmdline, name, label):
    assert bench["benchlib"].process_label(cmdline, name) == label


def test_tree_memory_keeps_the_breakdown_of_the_peak_sample(bench):
    """The per-process table is the sample of the highest summed PSS: its rows add up to the peak."""
    import os

    memory = bench["benchlib"].TreeMemory(os.getpid())
    memory.sample()
    rows = memory.peak_by_process
    assert rows["driver"]["processes"] == 1  # this process is the tree's root
    assert sum(r["pss_gib"] for r in rows.values()) == pytest.approx(memory.peak_pss_gib)
    assert sum(r["rss_gib"] for r in rows.values()) == pytest.approx(memory.peak_rss_gib)


def test_tree_memory_samples_at_nice_19_without_renicing_the_process(bench):
    """The sampling thread yields to the runs it measures; the rest of this process keeps its priority."""
    import os
    import time

    before = os.getpriority(os.PRIO_PROCESS, 0)
    memory = bench["benchlib"].TreeMemory(os.getpid(), interval_s=0.05).start()
    try:
        deadline = time.monotonic() + 10
        while memory.samples == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert memory.samples > 0
        assert os.getpriority(os.PRIO_PROCESS, memory._thread.native_id) == 19
    finally:
        memory.stop()
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_scaling_slope_is_least_squares():
    grpo = load_bench("grpo_vs_trl")
    assert grpo.slope([4, 8, 16], [10.0, 18.0, 34.0]) == 2.0  # exactly on a line: 2 s per prompt
    assert grpo.slope([64, 128, 256], [1.0, 3.0, 3.0]) == pytest.approx(1 / 112)  # hand-computed: 170.67 / 19114.7
    assert grpo.slope([4, 8, 16], [10.0, None, 34.0]) == 2.0  # a failed point is left out
    assert grpo.slope([4, 8, 16], [None, None, 3.0]) is None


def test_scaling_runs_each_point_and_fits_each_line(monkeypatch):
    """``--scaling``: one comparison per point (one size doubles, the rest stay; the shared base point runs once),
    slopes per run, a table row each."""
    import argparse

    grpo = load_bench("grpo_vs_trl")
    seen = []

    def fake_compare(model, spec, variants, timeout_s, keep):
        seen.append((spec.prompts_per_step, spec.max_new_tokens, spec.steps))
        cost = spec.prompts_per_step + spec.max_new_tokens / 16  # made-up step times: linear in both sizes
        return {"runs": {"trl": {"median_step_s": 2 * cost, "peak_pss_gib": 8.0},
                         "rlray-sync": {"median_step_s": cost, "peak_pss_gib": 10.0 + spec.prompts_per_step / 4}}}

    monkeypatch.setattr(grpo, "compare", fake_compare)
    args = argparse.Namespace(dtype="float32", placement="defaults", overrides=[], timeout_s=1.0, keep=False)
    base = dict(grpo.SIZES["default"]["smollm2-135m-instruct"], steps=4, warmup=2)
    out = grpo.scaling("smollm2-135m-instruct", base, ["trl", "rlray-sync"], args)
    assert seen == [(4, 64, 4), (8, 64, 4), (16, 64, 4), (4, 128, 4), (4, 256, 4)]  # the base point once, on both lines
    assert out["points"][3]["runs"] is out["points"][0]["runs"]
    assert out["slopes"]["prompts_per_step"]["trl"]["step_s_per_unit"] == pytest.approx(2.0)
    assert out["slopes"]["prompts_per_step"]["rlray-sync"]["pss_gib_per_unit"] == pytest.approx(0.25)
    assert out["slopes"]["max_new_tokens"]["rlray-sync"]["step_s_per_unit"] == pytest.approx(1 / 16)
    assert out["points"][2]["runs"]["rlray-sync"]["step_time_vs_trl"] == 0.5
    table = grpo.scaling_table(out)
    assert "| prompts_per_step | 16 | rlray-sync | 20.00 | 14.00 | 0.50 | 1.75 |" in table
    assert "- max_new_tokens: trl 0.125 s and 0.0000 GiB per new token" in table


def test_weight_sync_lora_tables_show_both_syncs_and_the_exactness(bench):
    runs = {
        "merged": {"bytes": 3 * 2**20, "export_s": [1.0, 0.5, 0.7], "seconds": [0.9, 0.6, 0.8],
                   "generate_tokens_per_s": 135.2, "engine_version": 3},
        "adapter": {"error": "exit code 1"},
        "exact": {"tokens": 40, "same_tokens": True, "max_diff_vs_merged": 3.4e-5, "max_diff_vs_learner": 2.5e-5,
                  "max_diff_vs_base": 0.82},
    }
    lines = bench["weight_sync"].lora_tables(runs).splitlines()
    assert lines[2] == "| merged | 3.00 | 0.700 | 0.800 | 135 | 3 |"  # medians of export and push seconds
    assert lines[3] == "| adapter | FAILED: exit code 1 | n/a | n/a | n/a | n/a |"
    assert lines[-1] == ("exactness (float32, 40 sampled tokens): same tokens yes; max |adapter - merged| 3.40e-05 nats, "
                         "max |adapter - learner| 2.50e-05 nats (the adapter's own effect: max |adapter - base| 8.20e-01 nats)")


def test_moved_rows_flag_a_ratio_that_moved_more_than_15_percent(bench):
    b = bench["benchlib"]
    rows = [["sync / TRL", 0.45, "<= 0.50", "yes"], ["async / sync", 1.2, "<= 1.00", "no"],
            ["rollout / vLLM", None, ">= 0.95", "n/a"], ["new ratio", 0.3, "", "n/a"], ["from zero", 0.1, "", "n/a"]]
    last = [["sync / TRL", 0.40], ["async / sync", 1.0], ["rollout / vLLM", 0.97], ["from zero", 0.0], ["gone", 2.0]]
    got = b.moved_rows(rows, last)
    assert [r[-2:] for r in got] == [[0.40, "+12.5%"],  # 0.45 / 0.40 = 1.125: not more than 15%
                                     [1.0, "MOVED +20.0%"], [0.97, "n/a"], [None, "new"], [0.0, "MOVED (from 0)"]]
    assert b.moved_rows([["x", 0.84]], [["x", 1.0]])[0][-1] == "MOVED -16.0%"  # a drop is flagged too
    assert b.moved_rows([["x", 0.5]], None) == [["x", 0.5, None, "new"]]


def test_run_all_compares_with_the_last_summary_of_the_same_sizes(bench):
    r = bench["run_all"]
    last = {"quick": False, "machine": {"git_commit": "abc1234"}, "rows": [{"measure": "x", "value": 1.0}]}
    assert r.last_rows(last, quick=False) == [["x", 1.0]]
    assert r.last_rows(last, quick=True) is None and r.last_rows(None, quick=False) is None
    compared = bench["benchlib"].moved_rows([["x", 1.3, "", "n/a"]], r.last_rows(last, quick=False))
    assert r.moved_line(compared, last) == ("MOVED more than 15% since the last recorded run (commit abc1234), check "
                                            "before trusting either: x (+30.0%)")
    still = bench["benchlib"].moved_rows([["x", 1.1, "", "n/a"]], [["x", 1.0]])
    assert r.moved_line(still, last) == "no ratio moved more than 15% since the last recorded run (commit abc1234)"
    assert r.moved_line(still, None).startswith("no earlier summary")
