"""One held tiny run serves the live page, its JSON, the console and TensorBoard checks (issue 13).

The module's run is a 2-step ``rlray train`` of configs/grpo_gsm8k_tiny.yaml (tiny-random, the transformers
backend, a length reward) as a subprocess on its own local Ray (no RAY_ADDRESS: not the session's cluster), with
``tracking.tensorboard_dir`` and a free monitor port. The step hook of tests/fixtures/holds.py, named in
``run.hooks`` with ``RLRAY_TEST_HOLD_AFTER_STEP=2``, makes it wait after step 2 is logged and sent to the monitor. While it waits, the
page's JSON equals what MLflow logged for steps 1-2 and chromium draws this run's curves and samples. Then
``HeldRun.finish`` creates the release file; the run ends, and its console and TensorBoard event files are checked.

The held checks come first in the file and pytest runs a module's tests in file order; a held check run after the
release fails and says so.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlray.observe import metrics
from rlray.observe.samples import rows_from_table
from rlray.observe.tracking import get_run_metrics, metrics_by_step, read_artifact_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import page_demo  # noqa: E402
from holds import HOLD_RELEASE_ENV, HOLD_STEP_ENV, SPEC  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = HOLD_STEP = 2  # held after the last step, before its snapshot: the page draws lines (2 points), not dots
START_TIMEOUT_S = 900.0  # seconds from the start of the subprocess to the hold, on 2 busy cores


@dataclass
class HeldRun:
    """The module's ``rlray train`` subprocess, held after ``HOLD_STEP`` until ``finish``."""

    folder: Path
    proc: subprocess.Popen
    port: int = 0
    run_id: str = ""
    result: dict | None = None

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.folder}/mlflow.db"

    @property
    def release(self) -> Path:
        return self.folder / "release"

    def output(self) -> tuple[str, str]:
        """Returns (stdout, stderr) of the subprocess so far."""
        return (self.folder / "stdout").read_text(), (self.folder / "stderr").read_text()

    def get(self, path: str) -> dict:
        """Returns the monitor's JSON document at ``path``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
            return json.loads(r.read())

    def wait_until_held(self) -> None:
        """Waits until the page has step ``HOLD_STEP``'s samples (sent after its metrics, before the hold)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"rlray train ended (exit {self.proc.returncode}) before the hold: {self.output()[1][-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no step {HOLD_STEP} on the page after {START_TIMEOUT_S:g} s: {self.output()[1][-3000:]}")
            if not self.port:
                stdout = self.output()[0]
                page_line = re.search(r"rlray: live page at http://127\.0\.0\.1:(\d+)/", stdout)
                run_line = re.search(r"rlray: MLflow run (\w+) in ", stdout)
                if page_line and run_line:
                    self.port, self.run_id = int(page_line[1]), run_line[1]
            if self.port and self.get("/api/samples")["step"] == HOLD_STEP:
                return
            time.sleep(1.0)

    def assert_held(self) -> None:
        assert self.result is None and self.proc.poll() is None, "the run was released already: run this module in file order"
        assert self.get("/health")["step"] == HOLD_STEP

    def finish(self) -> dict:
        """Releases the run, waits for the subprocess and returns the JSON result it printed (once)."""
        if self.result is None:
            self.release.touch()
            assert self.proc.wait(timeout=START_TIMEOUT_S) == 0, self.output()[1][-3000:]
            stdout = self.output()[0]
            self.result = json.loads(stdout[stdout.index("\n{") + 1 :])
        return self.result


@pytest.fixture(scope="module")
def held_run(tmp_path_factory, gsm8k_dir):
    folder = tmp_path_factory.mktemp("held")
    lines = (gsm8k_dir / "train.jsonl").read_text().splitlines()[:4]
    (folder / "train4.jsonl").write_text("\n".join(lines) + "\n")
    overrides = [f"data.train_files=[{folder}/train4.jsonl]", "eval.num_problems=0", f"run.max_steps={STEPS}",
                 f"run.output_dir={folder}/out", f"tracking.mlflow_uri=sqlite:///{folder}/mlflow.db", "monitor.port=0",
                 f"tracking.tensorboard_dir={folder}/tb", "rollout.backend=hf", "rollout.max_new_tokens=8",
                 "guard.kl_threshold=null", f"run.hooks=['{SPEC}']",
                 f"reward.functions=[{{function: '{REPO}/tests/fixtures/rewards.py:completion_length', weight: 1.0}}]"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {
        "PYTHONPATH": str(REPO), HOLD_STEP_ENV: str(HOLD_STEP), HOLD_RELEASE_ENV: str(folder / "release")}
    with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "rlray.cli", "train", str(REPO / "configs/grpo_gsm8k_tiny.yaml"),
                                 *overrides], stdout=out, stderr=err, env=env, cwd=folder, text=True)  # fmt: skip
    run = HeldRun(folder, proc)
    try:
        run.wait_until_held()
        yield run
    finally:
        run.release.touch()
        try:
            proc.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- while held ---------------------------------------------------------------------------------
@pytest.mark.ray
def test_page_json_gives_what_mlflow_logged_while_held(held_run):
    held_run.assert_held()
    health = held_run.get("/health")
    assert (health["run_id"], health["status"], health["step"]) == (held_run.run_id, "healthy", HOLD_STEP)
    assert health["snapshot_step"] is None  # the hold comes before the step's snapshot (the final one)
    doc = held_run.get("/api/metrics")
    assert doc["run_id"] == held_run.run_id and [p["step"] for p in doc["points"]] == [1, 2]
    logged = metrics_by_step(held_run.uri, held_run.run_id)
    for point in doc["points"]:
        shown = {k: math.nan if v is None else v for k, v in point["values"].items()}  # NaN travels as null
        expected = {k: v for k, v in logged[point["step"]].items() if metrics.is_charted(k)}
        assert shown == pytest.approx(expected, rel=0, abs=0, nan_ok=True), point["step"]
        assert {"reward/mean", "reward/completion_length", "learner/pg_loss", "algo/kl", "timing/step_s"} <= set(shown)
    assert held_run.get("/api/samples")["steps"] == [1, 2]
    for step in (1, 2):
        table = read_artifact_json(held_run.uri, held_run.run_id, f"samples/step_{step:06d}.json")
        samples = held_run.get(f"/api/samples?step={step}")["samples"]
        assert samples and samples == _approx(rows_from_table(table)), step


def _approx(value):
    """Returns ``value`` with each float inside it (dicts and lists too) compared to 1e-9: MLflow's tables keep 10
    decimals (pandas' to_json), the page's JSON every digit."""
    if isinstance(value, float):
        return pytest.approx(value, rel=0, abs=1e-9)
    if isinstance(value, dict):
        return {k: _approx(v) for k, v in value.items()}
    return [_approx(v) for v in value] if isinstance(value, list) else value


@pytest.mark.ray
def test_chromium_draws_this_runs_curves_and_samples_while_held(held_run, browser):
    from selenium.webdriver.common.by import By

    held_run.assert_held()
    browser.get(f"http://127.0.0.1:{held_run.port}/")
    page_demo.wait_for_page(browser)
    assert browser.find_element(By.ID, "run-id").text == held_run.run_id
    assert browser.find_element(By.ID, "step").text == str(HOLD_STEP)
    charts = browser.find_elements(By.CSS_SELECTOR, "#charts .chart")
    titles = [c.find_element(By.TAG_NAME, "h2").text for c in charts]
    assert titles[0] == "Reward (mean, each term, eval)"
    assert len(charts[0].find_elements(By.CSS_SELECTOR, "svg polyline")) == 2  # reward/mean, reward/completion_length
    lines = browser.find_elements(By.CSS_SELECTOR, "#charts svg polyline")
    assert len(lines) >= 10 and all(len(x.get_attribute("points").split()) == 2 for x in lines)  # steps 1 and 2
    # The policy loss chart's one curve (learner/pg_loss, the first colour) shows in a screenshot of the chart.
    loss_chart = charts[titles.index("Policy loss")].find_element(By.TAG_NAME, "svg")
    near, other = page_demo.coloured_pixels(loss_chart.screenshot_as_png, page_demo.CURVE_RGB)
    assert near > 100, f"only {near} pixels of the curve colour in the policy loss chart"
    assert other > near

    samples = held_run.get("/api/samples")["samples"]  # the newest step's: equal to MLflow's table (previous test)
    heads = [th.text.rstrip(" \u25bc\u25b2") for th in browser.find_elements(By.CSS_SELECTOR, "#sample-table thead th")]
    rows = browser.find_elements(By.CSS_SELECTOR, "#sample-table tbody tr")
    cells = [r.find_elements(By.TAG_NAME, "td") for r in rows]
    assert len(rows) == len(samples) > 0
    shown_tokens = sorted(int(c[heads.index("tokens")].text) for c in cells)
    assert shown_tokens == sorted(s["response_tokens"] for s in samples)
    shown_prompts = sorted(c[heads.index("prompt")].get_attribute("textContent") for c in cells)
    assert shown_prompts == sorted(s["prompt"] for s in samples)
    assert {c[heads.index("policy version")].text for c in cells} == {str(HOLD_STEP - 1)}
    steps = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#sample-step option")]
    assert steps == ["latest", "step 2", "step 1"]
    held_run.assert_held()  # the page's polls changed nothing


# ---- after the release ----------------------------------------------------------------------------
@pytest.mark.ray
def test_console_shows_start_lines_one_progress_line_per_step_and_keeps_the_logs(held_run):
    """The start lines, one plain progress line per step (a pipe is no terminal) ending at 100%, no library warnings
    or Ray lines on the console, and the full logs (driver.log, Ray's worker logs) in the run's folder."""
    result = held_run.finish()
    assert result["status"] == "FINISHED" and result["run_id"] == held_run.run_id
    stdout, stderr = held_run.output()
    shown = stdout + stderr
    for start in (f"rlray: MLflow run {result['run_id']} in ", f"rlray: live page at http://127.0.0.1:{held_run.port}/",
                  "rlray: snapshots under ", f"rlray: logs in {result['log_dir']}"):
        assert start in shown, start
    progress = [seg for seg in re.split(r"[\r\n]", stderr) if seg.startswith("rlray step ")]
    assert [x.split(" reward=")[0] for x in progress] == ["rlray step 1/2 (50%)", "rlray step 2/2 (100%)"], progress
    for chatter in ("FutureWarning", "UserWarning", "core_worker.cc", "RayTrainWorker", "(pid=", "Loading", "test hold"):
        assert chatter not in shown, chatter
    # Every console line is rlray's, from the first one on (issue 32: no Ray token-authentication warning, no MLflow
    # "Creating initial MLflow database tables..."); the JSON summary `rlray train` prints last is its own.
    lines = [x for x in re.split(r"[\r\n]", stdout[: stdout.index("\n{") + 1] + stderr) if x.strip()]
    assert lines and all(x.startswith(("rlray: ", "rlray step ")) for x in lines), lines
    log_dir = Path(result["log_dir"])
    assert f"rlray: full logs in {log_dir}: driver.log" in shown
    assert f"MLflow run {result['run_id']}" in (log_dir / "driver.log").read_text()
    worker_logs = "".join(p.read_text(errors="replace") for p in (log_dir / "ray").rglob("worker-*"))
    assert "rlray step 2/2" in worker_logs and f"test hold: waiting after step {HOLD_STEP}" in worker_logs


@pytest.mark.ray
def test_tensorboard_holds_every_scalar_mlflow_logged(held_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_id = held_run.finish()["run_id"]
    events = EventAccumulator(str(held_run.folder / "tb" / run_id))
    events.Reload()
    in_tensorboard = {k: sorted((e.step, e.value) for e in events.Scalars(k)) for k in events.Tags()["scalars"]}
    in_mlflow = get_run_metrics(held_run.uri, run_id)
    assert set(in_tensorboard) == set(in_mlflow) and [s for s, _ in in_mlflow["reward/mean"]] == [1, 2]
    for key, series in in_mlflow.items():  # TensorBoard stores float32: equal to float32 precision
        assert [s for s, _ in in_tensorboard[key]] == [s for s, _ in series], key
        assert [v for _, v in in_tensorboard[key]] == pytest.approx([v for _, v in series], rel=1e-6, nan_ok=True), key
