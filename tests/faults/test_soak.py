"""A long run under chaos: the tiny model for RLRAY_SOAK_STEPS steps (200 by default; `make soak`) with faults from
a seeded schedule. It must end FINISHED, with every step logged once, the prompt ledger exact and each fault counted
in its metric.

Faults, and where each is counted:
- rows of the data marked (seeded choice) 'reward_raise' (the reward function raises: reward/failed, G per row),
  'reward_hang' (it sleeps past its timeout_s: the whole step's samples fail, reward/failed P*G) and 'env_raise'
  (FlakyEnv raises in step: env/failed, G per row); they recur every epoch;
- from this process, at seeded steps: a rollout actor killed (rollout/actor_failures), a learner worker killed (Ray
  Train restores the latest snapshot: run/restored_step), the MLflow store taken away for OUTAGE_S seconds
  (monitor/mlflow_outages) and one snapshot's write failing (checkpoint/failures: its folder name is taken in
  advance by a dangling symlink, so creating the folder fails; the link is removed once the failure is counted).

Each process fault is set up while the run waits at a gate after the fault's step (``holds.Gates``, a step hook
released by a file), so the schedule holds whatever the steps' speed: a poll of MLflow raced tiny steps of ~0.25 s.

A 12-step run with each process fault once took 72 s (82 s with pytest's start) on 2 quiet AMD EPYC cores:
    RLRAY_SOAK_STEPS=12 pytest -q -m slow -s tests/faults/test_soak.py
The 200-step run (`make soak`), 16 process faults, took 354 s (6 min 07 s with pytest's start) there: every fault
counted, 4 restores, the ledger exact over 400 prompts.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rlray.checkpoint import storage as checkpoint
from rlray.config import load_config
from rlray.data import load_prompt_rows, prepare_prompts
from rlray.models import load_tokenizer
from rlray.observe.tracking import get_run, get_run_metrics, read_ledger
from rlray.run import ledger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from holds import GATE_FOLDER_ENV, GATE_STEPS_ENV, GATES_SPEC, arrived_file, release_file  # noqa: E402
from outages import store_down  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = int(os.environ.get("RLRAY_SOAK_STEPS", "200"))
SEED = int(os.environ.get("RLRAY_SOAK_SEED", "0"))
P, G = 2, 4  # prompts per step, samples per prompt
NUM_ROWS = 16
ROW_FAULTS = {"reward_raise": 2, "reward_hang": 1, "env_raise": 1}  # rows of each kind (one epoch = 8 steps)
ENV_ROWS = 4  # rows played in FlakyEnv (the env_raise ones among them)
PROCESS_FAULTS = ("kill_rollout", "kill_learner", "mlflow_down", "snapshot_fails")
OUTAGE_S = 8.0


def fault_plan(steps: int, seed: int) -> tuple[dict[int, str], list[tuple[int, str]]]:
    """Returns ({row index: row fault}, [(step, process fault)]): the seeded schedule.

    Row faults go to distinct rows; each process fault comes once per 50 steps (at least once), in a seeded order,
    spread evenly over steps 3..steps-2 so that one fault is over before the next begins.
    """
    rng = random.Random(seed)
    env_rows = rng.sample(range(NUM_ROWS), ENV_ROWS)
    plain = [i for i in range(NUM_ROWS) if i not in env_rows]
    rows = {env_rows[0]: "env_raise"}
    picked = rng.sample(plain, ROW_FAULTS["reward_raise"] + ROW_FAULTS["reward_hang"])
    rows.update({i: "reward_raise" for i in picked[:-1]} | {picked[-1]: "reward_hang"})
    rows.update({i: "" for i in env_rows[1:]})  # environment rows without a fault
    kinds = list(PROCESS_FAULTS) * max(1, steps // 50)
    rng.shuffle(kinds)
    span = max(steps - 5, 1)
    return rows, [(3 + round(k * span / len(kinds)), kind) for k, kind in enumerate(kinds)]


def _write_data(tmp_path: Path, gsm8k_dir: Path, rows_plan: dict[int, str], env_rows: set[int]) -> Path:
    source = [json.loads(line) for line in (gsm8k_dir / "train.jsonl").read_text().splitlines()[:NUM_ROWS]]
    out = tmp_path / "soak.jsonl"
    with out.open("w") as f:
        for i, row in enumerate(source):
            item = {"id": f"soak-{i:03d}", "question": row["question"], "answer": row["answer"],
                    "fault": rows_plan.get(i, "")}  # fmt: skip
            if i in env_rows:
                item["environment"] = "flaky"
            f.write(json.dumps(item) + "\n")
    return out


def _actor_pids(class_name: str) -> list[int]:
    import ray._private.state  # the GCS actor table; ray.util.state needs the dashboard, off in tests

    return [a["Pid"] for a in ray._private.state.actors().values() if a["ActorClassName"] == class_name and a["State"] == "ALIVE"]




class _Progress:
    """Reads the run's progress from MLflow (None while the store is away)."""

    def __init__(self, uri: str, experiment: str):
        self.client, self.experiment = MlflowClient(uri), experiment

    def run_id(self) -> str | None:
        exp = self.client.get_experiment_by_name(self.experiment)
        runs = self.client.search_runs([exp.experiment_id]) if exp else []
        return runs[0].info.run_id if runs else None

    def count(self, run_id: str, key: str) -> int:
        return len(self.client.get_metric_history(run_id, key))

    def step(self, run_id: str) -> int:
        return max((m.step for m in self.client.get_metric_history(run_id, "timing/step_s")), default=0)


def _wait(predicate, timeout_s: float, what: str, alive: threading.Thread):
    """Returns ``predicate()`` once it is true; raises AssertionError after ``timeout_s`` or once the training thread
    has ended with it still false (it is asked once more after the thread ended: a fast run may finish first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = alive.is_alive()
        try:
            got = predicate()
        except Exception:  # the store may be away or busy for a moment
            got = None
        if got:
            return got
        if not running or time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} (training thread alive: {alive.is_alive()})")
        time.sleep(0.5)


def snapshot_target(step: int, every: int) -> int:
    """The step of the snapshot a ``snapshot_fails`` fault at ``step`` blocks: the first one written after the gate
    at ``step`` (a control hook runs before its step's snapshot, so that may be ``step``'s own)."""
    return -(-step // every) * every


def _inject(kind: str, step: int, gates: Path, progress: _Progress, rid: str, db: Path, run_dir: Path, every: int,
            thread: threading.Thread) -> None:
    """Applies one process fault while the run stands at the gate after ``step`` (``holds.Gates``), lets it go on and
    returns when the fault is over (counted in MLflow).

    Each fault is set up at its seeded step whatever the run's speed: a poll of MLflow raced a run whose steps took
    0.25 s (the snapshot to block existed before the link went in).
    """
    _wait(lambda: arrived_file(gates, step).exists(), 1800, f"the gate after step {step}", thread)
    go = release_file(gates, step).touch
    if kind == "kill_rollout":
        os.kill(_actor_pids("RolloutActor")[0], signal.SIGKILL)
        go()
        _wait(lambda: progress.step(rid) >= step + 2, 1800, "two steps after the rollout actor kill", thread)
    elif kind == "kill_learner":
        before = progress.count(rid, "run/restored_step")
        os.kill(_actor_pids("RayTrainWorker")[0], signal.SIGKILL)  # rank 0, waiting in the gate
        go()  # the restarted worker passes this gate when it replays the step
        _wait(lambda: progress.count(rid, "run/restored_step") > before, 1800, "the learner's restore", thread)
    elif kind == "mlflow_down":
        with store_down(db):  # the steps after the gate log while the store is away
            go()
            time.sleep(OUTAGE_S)
        _wait(lambda: progress.step(rid) >= step + 2, 1800, "two steps after the outage", thread)
    elif kind == "snapshot_fails":
        before = progress.count(rid, "checkpoint/failures")
        blocked = run_dir / checkpoint.snapshot_name(snapshot_target(step, every))
        blocked.symlink_to(run_dir / "no-such-file" / "x")  # a dangling link: makedirs under it fails (EEXIST)
        go()
        try:
            _wait(lambda: progress.count(rid, "checkpoint/failures") > before, 1800,
                  f"the failed snapshot of step {snapshot_target(step, every)}", thread)
        finally:
            blocked.unlink()


@pytest.mark.ray
@pytest.mark.slow  # RLRAY_SOAK_STEPS=200: about 6 minutes on 2 cores; `make soak`
def test_a_long_run_under_seeded_chaos_finishes_with_an_exact_ledger(ray_session, tmp_path, gsm8k_dir, tiny_model_path,
                                                                   monkeypatch):
    from rlray.launch.driver import run_training

    rows_plan, schedule = fault_plan(STEPS, SEED)
    env_rows = {i for i, f in rows_plan.items() if f in ("env_raise", "")}
    data = _write_data(tmp_path, gsm8k_dir, rows_plan, env_rows)
    db, root = tmp_path / "mlflow.db", tmp_path / "ckpt"
    uri = f"sqlite:///{db}"
    learner_kills = sum(k == "kill_learner" for _, k in schedule)
    gates = tmp_path / "gates"  # the run waits after each fault's step until the fault is set up (holds.Gates)
    gates.mkdir()
    monkeypatch.setenv(GATE_STEPS_ENV, ",".join(str(step) for step, _ in schedule))
    monkeypatch.setenv(GATE_FOLDER_ENV, str(gates))
    cfg = load_config(REPO / "configs/grpo_gsm8k_tiny.yaml", [
        f"data.train_files=[{data}]", "eval.num_problems=2", f"eval.every_steps={max(STEPS // 4, 1)}",
        f"run.max_steps={STEPS}", f"run.seed={SEED}", f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}",
        "tracking.experiment=soak", "rollout.backend=hf", "rollout.max_new_tokens=8", f"rollout.samples_per_prompt={G}",
        f"learner.prompts_per_step={P}", "checkpoint.every_steps=2", f"checkpoint.uri={root}", "guard.kl_threshold=null",
        "resources.rollout.num_workers=2", "resources.rollout.max_restarts=4", f"monitor.max_failures={learner_kills + 1}",
        "monitor.restart_delay_s=1", "monitor.heartbeat_s=30",
        f"reward.functions=[{{function: '{REPO}/tests/fixtures/faulty_rewards.py:scheduled', weight: 1.0, timeout_s: 2.0}}]",
        f"env.environments={{flaky: '{REPO}/tests/fixtures/test_envs.py:FlakyEnv'}}", "env.max_turns=1",
        # a reward_hang row fails its whole step by design, and two such steps can meet at an epoch's boundary
        "guard.max_failed_steps=3", f"run.hooks=['{GATES_SPEC}']",
    ])  # fmt: skip
    started = time.monotonic()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(r=run_training(cfg)), daemon=True)
    thread.start()
    progress = _Progress(uri, "soak")
    rid = _wait(progress.run_id, 600, "the MLflow run", thread)
    for step, kind in schedule:
        _inject(kind, step, gates, progress, rid, db, root / checkpoint.run_dir_name(rid), cfg.checkpoint.every_steps, thread)
    thread.join(timeout=STEPS * 60)
    assert not thread.is_alive() and "r" in result, "the run did not end"
    wall_s = time.monotonic() - started

    res = result["r"]
    assert res.status == "FINISHED" and get_run(uri, rid).info.status == "FINISHED"
    metrics = get_run_metrics(uri, rid)
    assert [s for s, _ in metrics["timing/step_s"]] == list(range(1, STEPS + 1))  # every step logged once
    assert [s for s, _ in metrics["reward/failed"]] == list(range(1, STEPS + 1))

    # the ledger: every prompt of each epoch once, in order, among the steps that survived
    rows = load_prompt_rows(cfg.data.train_files, prompt_column=cfg.data.prompt_column)
    kept, _, _ = prepare_prompts(rows, load_tokenizer(tiny_model_path, cfg.model.chat_template),
                                 max_prompt_tokens=cfg.data.max_prompt_tokens, instruction=cfg.data.instruction,
                                 system_prompt=cfg.data.system_prompt)  # fmt: skip
    report = ledger.check_run(uri, rid, kept, seed=SEED, shuffle=cfg.data.shuffle)
    assert report.ok, report.summary()
    assert report.consumed == STEPS * P

    # each fault counted in its metric
    fault_of = {f"soak-{i:03d}": f for i, f in rows_plan.items()}
    steps = read_ledger(uri, rid)
    want_failed, want_env = 0, 0
    for ids in steps.values():
        kinds = [fault_of.get(pid, "") for pid in ids]
        want_failed += P * G if "reward_hang" in kinds else G * (kinds.count("reward_raise") + kinds.count("env_raise"))
        want_env += G * kinds.count("env_raise")
    total = {k: sum(v for _, v in metrics.get(k, [])) for k in
             ("reward/failed", "env/failed", "rollout/actor_failures", "monitor/mlflow_outages", "checkpoint/failures")}
    counts = {kind: sum(k == kind for _, k in schedule) for kind in PROCESS_FAULTS}
    print(f"soak: {STEPS} steps in {wall_s:.0f} s; faults {counts}, rows {ROW_FAULTS}; counted {total}; "
          f"restores {len(metrics.get('run/restored_step', []))}; {report.summary()}")
    assert total["reward/failed"] == want_failed and total["env/failed"] == want_env
    assert total["rollout/actor_failures"] == counts["kill_rollout"]
    assert len(metrics["run/restored_step"]) == counts["kill_learner"]
    assert total["monitor/mlflow_outages"] == counts["mlflow_down"]
    assert total["checkpoint/failures"] == counts["snapshot_fails"]


def test_the_fault_plan_is_seeded_and_spread():
    rows, schedule = fault_plan(200, 0)
    assert rows == fault_plan(200, 0)[0] and schedule == fault_plan(200, 0)[1]
    assert sorted(f for f in rows.values() if f) == ["env_raise", "reward_hang", "reward_raise", "reward_raise"]
    assert len(schedule) == 16 and {k for _, k in schedule} == set(PROCESS_FAULTS)
    steps = [s for s, _ in schedule]
    assert steps == sorted(steps) and steps[0] == 3 and steps[-1] <= 198 and min(b - a for a, b in zip(steps, steps[1:], strict=False)) >= 12
    assert [s for s, _ in fault_plan(12, 0)[1]] == [3, 5, 7, 8]  # the short run: each process fault once
    assert [snapshot_target(s, 2) for s in (3, 4, 5)] == [4, 4, 6]  # the first snapshot after the gate
