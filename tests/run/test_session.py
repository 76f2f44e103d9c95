"""The session around the steps, run in-process (``rlray.run.worker.train``, world size 1) against one real
vLLM rollout actor: exact resume, the epoch boundary, lineage, rollback, guards, the OOM fallback and a
full disk. Heartbeats and /health through the driver are in tests/run/test_restart.py."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from rlray.checkpoint import lineage
from rlray.checkpoint import storage as checkpoint
from rlray.cli import main as cli_main
from rlray.config import Config, load_config
from rlray.hangs import HangError
from rlray.observe.metrics import METRIC_KEYS, term_keys
from rlray.observe.tracking import Tracker, get_run, get_run_metrics
from rlray.plan import resolve_plan
from rlray.run import online, worker
from rlray.run.session import FatalStepError
from rlray.run.state import RunOutcome, RunServices, WorkerArgs

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
sys.path.insert(0, str(FIXTURES))
import faultyfs  # noqa: E402

faultyfs.register()
pytestmark = pytest.mark.ray


@dataclass
class Env:
    base: Path
    uri: str
    model_path: str
    actors: list


@pytest.fixture(scope="module")
def env(ray_session, tmp_path_factory, tiny_model_path, gsm8k_dir):
    from rlray.launch.actors import start_rollout_actors
    from rlray.launch.driver import max_model_len
    from rlray.plan import resolve_plan

    base = tmp_path_factory.mktemp("ops")
    # 4 prompts at 2 per step: one epoch is 2 steps, so step 2 ends exactly at an epoch boundary
    lines = (gsm8k_dir / "train.jsonl").read_text().splitlines()[:4]
    (base / "train4.jsonl").write_text("\n".join(lines) + "\n")
    env = Env(base, f"sqlite:///{base}/mlflow.db", tiny_model_path, [])
    cfg = make_cfg(env, "probe")
    env.actors = start_rollout_actors(resolve_plan(cfg), tiny_model_path, max_model_len(cfg))
    yield env
    for a in env.actors:
        ray.kill(a)


def make_cfg(env: Env, name: str, *overrides: str) -> Config:
    """The tiny config on 4 prompts, lr 1e-3 and a length reward (a random model gets a signal), no eval."""
    from rlray.launch.driver import resolve_paths

    cfg = load_config(REPO / "configs/grpo_gsm8k_tiny.yaml", [
        f"data.train_files=[{env.base}/train4.jsonl]", "eval.num_problems=0", "run.max_steps=4", "learner.lr=1e-3",
        f"run.output_dir={env.base}/{name}", f"tracking.mlflow_uri={env.uri}", f"tracking.experiment={name}",
        "checkpoint.every_steps=2", "guard.kl_threshold=null", "monitor.heartbeat_s=1",
        f"reward.functions=[{{function: '{FIXTURES}/rewards.py:completion_length', weight: 1.0}}]", *overrides])
    return resolve_paths(cfg)


def run(env: Env, cfg: Config, *, monitor: bool = False, actors: list | None = None,
        **services) -> tuple[RunOutcome, str, object]:
    """Runs ``train`` in this process (on ``actors``, default the module's rollout actors); returns (outcome, MLflow run
    id, (monitor actor, port) or None)."""
    from rlray.launch.monitor_actor import start_monitor

    tracker = Tracker(cfg.tracking.mlflow_uri, cfg.tracking.experiment)
    plan = resolve_plan(cfg)
    mon = start_monitor(plan, tracker.run_id) if monitor else None
    args = WorkerArgs(cfg.model_dump(), env.model_path, tracker.run_id, env.actors if actors is None else actors,
                      services=RunServices(monitor=mon and mon[0], **services))
    out = worker.train(plan, args)
    return out, tracker.run_id, mon


def series(env: Env, run_id: str, key: str) -> list[tuple[int, float]]:
    return get_run_metrics(env.uri, run_id).get(key, [])


def history(env: Env, run_id: str, key: str) -> list[tuple[int, float]]:
    """Returns [(step, value)] in the order they were logged (a rollback logs some steps twice)."""
    from mlflow.tracking import MlflowClient

    found = MlflowClient(env.uri).get_metric_history(run_id, key)
    return [(m.step, m.value) for m in sorted(found, key=lambda m: m.timestamp)]


# --------------------------------------------------------------------------------------------
# Exact resume, the epoch boundary, lineage (one set of runs shared by the tests below)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resumed(env):
    """A: 4 straight steps. B: the same config crashes in step 3. C: resumes B's latest snapshot for 2 steps."""
    a_out, a_id, _ = run(env, make_cfg(env, "straight"))
    b_cfg = make_cfg(env, "crashed", "tracking.experiment=resume")
    real_step = online.run_step

    def crash_in_step_3(ctx, step):
        if step == 2:
            raise RuntimeError("injected crash in step 3")
        return real_step(ctx, step)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(online, "run_step", crash_in_step_3)
        with pytest.raises(RuntimeError, match="injected crash"):
            run(env, b_cfg)
    b_id = next(r for r in _runs(env, "resume"))
    c_cfg = make_cfg(env, "crashed", "tracking.experiment=resume", "checkpoint.resume_from=latest")
    source = checkpoint.resolve_snapshot(c_cfg.checkpoint.resume_from, c_cfg.checkpoint_uri)
    c_out, c_id, _ = run(env, c_cfg, resume_from=source)
    return {"a": (a_out, a_id), "b_id": b_id, "c": (c_out, c_id), "source": source}


def _runs(env: Env, experiment: str) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env.uri)
    exp = client.get_experiment_by_name(experiment)
    return [r.info.run_id for r in client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])]


def test_resume_reproduces_the_uninterrupted_run(env, resumed):
    a_out, a_id = resumed["a"]
    c_out, c_id = resumed["c"]
    assert (a_out.status, a_out.step, c_out.status, c_out.step) == ("FINISHED", 4, "FINISHED", 4)
    assert resumed["source"].endswith("step_00000002") and f"run-{resumed['b_id']}" in resumed["source"]
    for key in ("reward/mean", "learner/loss", "learner/grad_norm", "algo/kl", "rollout/response_tokens_mean"):
        straight = dict(series(env, a_id, key))
        crashed = dict(series(env, resumed["b_id"], key))
        again = dict(series(env, c_id, key))
        assert sorted(again) == [3, 4], key  # only the steps after the snapshot ran
        assert [crashed[s] for s in (1, 2)] == [straight[s] for s in (1, 2)], key
        assert [again[s] for s in (3, 4)] == [straight[s] for s in (3, 4)], key
    assert dict(series(env, a_id, "learner/grad_norm"))[4] > 0  # the steps did update the policy
    declared = set(METRIC_KEYS) | set(term_keys(["completion_length"]))
    assert set(get_run_metrics(env.uri, a_id)) <= declared  # every logged key is listed once
    straight_w = load_file(f"{a_out.last_snapshot}/model/model.safetensors")
    resumed_w = load_file(f"{c_out.last_snapshot}/model/model.safetensors")
    assert all(torch.equal(straight_w[k], resumed_w[k]) for k in straight_w)
    initial = load_file(f"{env.model_path}/model.safetensors")
    assert not torch.equal(initial["model.embed_tokens.weight"], straight_w["model.embed_tokens.weight"])


def test_resume_at_an_epoch_boundary_continues_into_the_next_epoch(env, resumed):
    c_out, c_id = resumed["c"]
    manifest = checkpoint.read_manifest(resumed["source"])
    assert (manifest.step, manifest.epoch, manifest.data_cursor["position"]) == (2, 1, 0)
    assert manifest.policy_version == 2 and set(manifest.files) >= {"model/model.safetensors", "trainer_state.pt",
                                                                          "rng/rank_0.pt", "config.yaml"}
    # steps 3 and 4 ran (epoch 1, then epoch 2 begins), instead of zero steps and a clean exit
    assert series(env, c_id, "data/epoch") == [(3, 1.0), (4, 2.0)]
    assert series(env, c_id, "rollout/policy_version") == [(3, 2.0), (4, 3.0)]
    assert series(env, c_id, "run/restored_step") == [(2, 2.0)]
    assert get_run(env.uri, c_id).data.tags["rlray.restored_from"] == resumed["source"]


def test_lineage_follows_a_resumed_run_back_to_its_first_snapshot(env, resumed, capsys):
    c_out, c_id = resumed["c"]
    mine = lineage.run_versions(env.uri, "resume", c_id)
    assert [v["tags"]["rlray.step"] for v in mine] == ["4"]
    chain = lineage.chain(env.uri, "resume", mine[-1]["version"])
    assert [(v["tags"]["rlray.step"], v["run_id"]) for v in chain] == [("4", c_id), ("2", resumed["b_id"])]
    assert chain[-1]["tags"]["rlray.parent_version"] == ""  # the crashed run's first snapshot is the root
    assert chain[0]["tags"]["rlray.parent_version"] == chain[1]["version"]
    tags = chain[0]["tags"]
    assert tags["rlray.dataset_hash"] == chain[1]["tags"]["rlray.dataset_hash"] and len(tags["rlray.dataset_hash"]) == 16
    assert tags["rlray.config_hash"] and tags["rlray.git_commit"] and float(tags["metric.reward/mean"]) > 0
    assert chain[0]["source"] == c_out.last_snapshot
    args = ["--set", f"tracking.mlflow_uri={env.uri}", "--set", "tracking.experiment=resume"]
    assert cli_main(["models", "show", c_id, *args]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].startswith("rlray-resume") and len(shown) == 4  # title, header, 2 versions
    assert shown[2].split()[:3] == [chain[0]["version"], chain[1]["version"], "4"]
    assert cli_main(["models", "list", "--run", resumed["b_id"], *args]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_rollback_cli_prepares_a_resume_with_the_trained_config(env, resumed, capsys, tmp_path):
    _, a_id = resumed["a"]
    args = ["--set", f"tracking.mlflow_uri={env.uri}", "--set", "tracking.experiment=straight"]
    assert cli_main(["rollback", a_id, "--to", "2", "--dest", str(tmp_path / "rb"), *args]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["step"] == 2 and got["snapshot"].endswith(f"run-{a_id}/step_00000002")
    cfg = load_config(got["config"])
    assert cfg.checkpoint.resume_from == got["snapshot"] and cfg.learner.lr == 1e-3
    assert got["command"] == f"rlray train {got['config']}"
    version = lineage.version_of(env.uri, "straight", got["snapshot"])
    assert cli_main(["rollback", a_id, "--to", f"v{version}", "--dest", str(tmp_path / "rb2"), *args]) == 0
    assert json.loads(capsys.readouterr().out)["snapshot"] == got["snapshot"]
    assert cli_main(["rollback", a_id, "--to", "3", *args]) == 2  # no snapshot at step 3 (every 2 steps)
    assert "no complete snapshot at step 3" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Guards
# --------------------------------------------------------------------------------------------
def test_kl_guard_stops_the_run_and_tags_it(env):
    # tiny-random at lr 1e-3: KL 0 at step 1 (policy == reference), ~0.02 nats/token at step 2
    cfg = make_cfg(env, "klstop", "guard.kl_threshold=0.01", "checkpoint.every_steps=1")
    out, run_id, monitor = run(env, cfg, monitor=True)
    assert (out.status, out.step) == ("stopped: kl_guard", 2)
    tags = get_run(env.uri, run_id).data.tags
    assert (tags["rlray.stop_reason"], tags["rlray.stop_step"], tags["rlray.status"]) == ("kl_guard", "2", "stopped: kl_guard")
    kl = dict(series(env, run_id, "algo/kl"))
    assert kl[1] == 0.0 and kl[2] > 0.01 and f"{kl[2]:.4g} nats > guard.kl_threshold=0.01" in tags["rlray.stop_message"]
    assert tags["rlray.alert.guard_trip"].startswith("kl_guard: step 2") and "stopping" in tags["rlray.alert.guard_trip"]
    health = ray.get(monitor[0].health.remote())
    assert (health["status"], health["reason"]) == ("stopped", "kl_guard")
    # the drifted state is not kept: the last snapshot is step 1's
    assert [s.step for s in checkpoint.list_snapshots(cfg.checkpoint_uri)] == [1]


def test_kl_trip_rolls_back_with_half_the_learning_rate(env):
    # KL at lr 1e-3: step 2 ~0.019, step 3 ~0.037. A trip at step 3 blames the state after step 2, so the
    # last good snapshot is step 1's; halving the lr for the redone step 2 lowers step 3's KL (to ~0.032).
    cfg = make_cfg(env, "rollback", "guard.kl_threshold=0.028", "guard.on_trip=rollback", "guard.max_rollbacks=1",
                   "checkpoint.every_steps=1", "run.max_steps=3")
    out, run_id, _ = run(env, cfg)
    tags = get_run(env.uri, run_id).data.tags
    assert tags["rlray.rollback.1"] == "step 3 -> step 1; learner.lr: 0.001 -> 0.0005"
    kl3 = [v for s, v in history(env, run_id, "algo/kl") if s == 3]
    assert len(kl3) >= 2 and kl3[0] > 0.028 and kl3[1] < kl3[0]
    assert history(env, run_id, "learner/lr") == [(1, 1e-3), (2, 1e-3), (3, 1e-3), (2, 5e-4), (3, 5e-4)]
    snaps = {s.step: s for s in checkpoint.list_snapshots(cfg.checkpoint_uri) if s.complete}
    # the redone step 3 still trips (0.032 > 0.028) and no rollback is left: the run stops there
    assert (out.status, out.step, tags["rlray.rollbacks"]) == ("stopped: kl_guard", 3, "1")
    trained = load_config_text(checkpoint.join(snaps[max(snaps)].uri, "config.yaml"))
    assert trained["learner"]["lr"] == 5e-4 and snaps[max(snaps)].manifest.rollbacks == 1


def load_config_text(uri: str) -> dict:
    import yaml

    return yaml.safe_load(Path(uri).read_text())


def test_nonfinite_steps_are_skipped_then_stop(env):
    # stage 5 hands the update NaN advantages (as an overflowing reward model would): the loss and the
    # gradients are NaN, the learner skips the optimizer step, and the guard stops after 2 in a row
    seen = []

    real_update = online.update_policy

    def nan_advantages(ctx, data, norms, spec):
        seen.append(ctx.learner)
        data.advantages = torch.full(data.response_mask.shape, math.nan)
        return real_update(ctx, data, norms, spec)

    cfg = make_cfg(env, "nonfinite", "guard.max_nonfinite_steps=2")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(online, "update_policy", nan_advantages)
        out, run_id, _ = run(env, cfg)
    assert (out.status, out.step) == ("stopped: nonfinite", 2)
    assert series(env, run_id, "guard/nonfinite_in_row") == [(1, 1.0), (2, 2.0)]
    assert all(math.isnan(v) for _, v in series(env, run_id, "learner/loss") + series(env, run_id, "learner/grad_norm"))
    assert get_run(env.uri, run_id).data.tags["rlray.stop_reason"] == "nonfinite"
    assert checkpoint.list_snapshots(cfg.checkpoint_uri) == []
    initial = load_file(f"{env.model_path}/model.safetensors")
    now = seen[-1].module.state_dict()
    assert all(torch.equal(initial[k], now[k]) for k in initial)  # both updates were skipped


def test_wall_time_and_memory_cap_stop_after_a_snapshot(env):
    cfg = make_cfg(env, "walltime", "run.max_wall_time_s=60")
    out, run_id, _ = run(env, cfg, started_at=time.time() - 3600)
    assert (out.status, out.step) == ("stopped: wall_time", 1)
    assert out.last_snapshot.endswith("step_00000001") and checkpoint.read_manifest(out.last_snapshot).kind == "stop"
    cfg = make_cfg(env, "memcap", "guard.memory_cap_gib=0.05")
    out, run_id, _ = run(env, cfg)
    assert (out.status, out.step) == ("stopped: memory_cap", 1)
    message = get_run(env.uri, run_id).data.tags["rlray.stop_message"]
    assert "exceeds the cap 0.05 GiB (guard.memory_cap_gib" in message


def test_a_hang_under_on_hang_stop_ends_the_run_failed_after_a_snapshot_of_the_last_finished_step(env):
    """watchdog.on_hang=stop: the fleet's HangError in step 2's stages 1-3 (injected where the fleet raises it) stops
    every rank with the report as rlray.error, after a 'stop' snapshot of step 1 (checkpoint.every_steps=2: none was
    due there)."""
    cfg = make_cfg(env, "hangstop", "watchdog.on_hang=stop", "run.max_steps=3")
    real = online.collect_experience

    def hang_in_step_2(lead, plan, tokenizer, step, timer, **kwargs):
        if step == 1:
            raise HangError("hang: rollout actor 0 (rlray:rollout-0) ... has run generate for 3.1 s (injected)")
        return real(lead, plan, tokenizer, step, timer, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(online, "collect_experience", hang_in_step_2)
        with pytest.raises(FatalStepError, match=r"^HangError: hang: rollout actor 0 \(rlray:rollout-0\)"):
            run(env, cfg)
    run_id = _runs(env, "hangstop")[-1]
    tags = get_run(env.uri, run_id).data.tags
    assert tags["rlray.status"] == "FAILED" and tags["rlray.error"].startswith("HangError: hang: rollout actor 0")
    snap = checkpoint.latest_snapshot(checkpoint.join(cfg.checkpoint_uri, checkpoint.run_dir_name(run_id)))
    manifest = checkpoint.read_manifest(snap)
    assert (manifest.step, manifest.kind) == (1, "stop")


def test_a_hang_in_evaluation_under_on_hang_stop_keeps_the_step_then_ends_the_run_failed(env):
    """watchdog.on_hang=stop: rank 0's evaluation raises the fleet's HangError (injected where the fleet raises it: a
    generate past its deadline, or the first generate after a weight push that hung, the start's included). After step
    2 the step boundary logs step 2, keeps it in a 'stop' snapshot (in place of the periodic one due there) and stops
    every rank with the report as rlray.error; at the start's evaluation the run stops before any step, nothing to keep.
    """
    real, calls = online.evaluate, []

    def hang_at(call: int):
        def evaluate(ctx):
            calls.append(call)
            if len(calls) == call:
                raise HangError("hang: rollout actor 0 (rlray:rollout-0) ... has run generate for 3.1 s (injected)")
            return real(ctx)
        return evaluate

    for name, call in (("evalhang", 3), ("evalhang0", 1)):  # the start's evaluation, after step 1, after step 2
        calls.clear()
        cfg = make_cfg(env, name, "watchdog.on_hang=stop", "run.max_steps=3", "eval.num_problems=2",
                       "eval.every_steps=1")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(online, "evaluate", hang_at(call))
            with pytest.raises(FatalStepError, match=r"^HangError in evaluation: hang: rollout actor 0 \(rlray:rollout"):
                run(env, cfg)
        run_id = _runs(env, name)[-1]
        tags = get_run(env.uri, run_id).data.tags
        assert tags["rlray.status"] == "FAILED"
        assert tags["rlray.error"].startswith("HangError in evaluation: hang: rollout actor 0")
        run_dir = checkpoint.join(cfg.checkpoint_uri, checkpoint.run_dir_name(run_id))
        if call == 3:
            assert [s for s, _ in series(env, run_id, "learner/loss")] == [1, 2]
            assert [s for s, _ in series(env, run_id, "eval/reward_mean")] == [0, 1]
            manifest = checkpoint.read_manifest(checkpoint.latest_snapshot(run_dir))
            assert (manifest.step, manifest.kind) == (2, "stop")
        else:
            assert series(env, run_id, "learner/loss") == [] and checkpoint.latest_snapshot(run_dir) is None


def test_an_async_runs_hang_in_evaluation_under_stop_keeps_its_rollout_in_flight_for_the_resume(env):
    """Async (rollout.max_staleness=1, overlap on), watchdog.on_hang=stop: the evaluation after step 2 raises the
    fleet's HangError while step 3's rollout, submitted at step 2's start with version 1, is in flight. The 'stop'
    snapshot of step 2 keeps that rollout (collected from the same fleet before the snapshot), and a resume from it
    trains step 3 on those samples (staleness 1, nothing sampled again) instead of sampling them with the snapshot's
    weights, so the joined prompt ledger takes every prompt exactly once."""
    from rlray.checkpoint import contents
    from rlray.observe.tracking import read_ledger
    from rlray.run import ledger

    real, calls = online.evaluate, []

    def hang_after_step_2(ctx):
        calls.append(len(calls))
        if len(calls) == 3:  # the start's evaluation, after step 1, after step 2
            raise HangError("hang: rollout actor 0 (rlray:rollout-0) ... has run generate for 3.1 s (injected)")
        return real(ctx)

    extra = ("watchdog.on_hang=stop", "eval.num_problems=2", "eval.every_steps=1", "rollout.max_staleness=1",
             "rollout.overlap=on")
    cfg = make_cfg(env, "evalhang_async", *extra)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(online, "evaluate", hang_after_step_2)
        with pytest.raises(FatalStepError, match=r"^HangError in evaluation: hang: rollout actor 0"):
            run(env, cfg)
    first = _runs(env, "evalhang_async")[-1]
    snap = checkpoint.latest_snapshot(checkpoint.join(cfg.checkpoint_uri, checkpoint.run_dir_name(first)))
    manifest = checkpoint.read_manifest(snap)
    assert (manifest.step, manifest.kind) == (2, "stop") and len(manifest.data_cursor["in_flight"]) == 1
    kept = contents.read_in_flight(snap, manifest, None)
    assert len(kept) == 1 and kept[0]["version"] == 1
    assert len(kept[0]["completions"]) == cfg.learner.prompts_per_step * cfg.rollout.samples_per_prompt

    resumed = make_cfg(env, "evalhang_async", *extra, "checkpoint.resume_from=latest")
    out, second, _ = run(env, resumed, resume_from=checkpoint.resolve_snapshot("latest", resumed.checkpoint_uri))
    assert (out.status, out.step) == ("FINISHED", 4)
    assert series(env, second, "rollout/staleness_max")[0] == (3, 1.0)  # step 3 trained the kept version-1 samples
    assert all(v == 0.0 for _, v in series(env, second, "rollout/rerun_prompts"))
    got = {s: ids for s, ids in read_ledger(env.uri, first).items() if s <= 2} | read_ledger(env.uri, second)
    report = ledger.check_ledger(got, ledger.training_rows(resolve_plan(cfg)), seed=cfg.run.seed,
                                 shuffle=cfg.data.shuffle, last_step=4, prompts_per_step=cfg.learner.prompts_per_step,
                                 max_staleness=1)
    assert report.ok and report.consumed == 4 * cfg.learner.prompts_per_step, report.summary()


def test_a_hang_in_the_starts_weight_push_under_on_hang_stop_stops_the_run_at_its_first_generate(env, tmp_path):
    """watchdog.on_hang=stop: the start's push to a rollout actor hangs (``injected_hang``, a real stuck process); the
    fleet reports it after watchdog.weight_push_s with the actor's stacks and restarts the actor, and the first generate
    stops the run: the start's evaluation (a stop agreed by every rank, no step to keep) or, without evaluation, step
    1's rollout (stages 1-3)."""
    from tests.rollout.test_fleet import FakeRolloutActor

    cls = ray.remote(FakeRolloutActor).options(num_cpus=0.01, max_restarts=1, max_task_retries=0)
    for name, evaluation, first in (("pushhang", "eval.num_problems=2", "HangError in evaluation"),
                                    ("pushhang1", "eval.num_problems=0", "HangError")):
        actor, flag = cls.remote(), tmp_path / f"{name}.hang"
        flag.touch()
        ray.get(actor.arm_hang.remote(str(flag)))
        cfg = make_cfg(env, name, "watchdog.on_hang=stop", "watchdog.weight_push_s=3", evaluation)
        t = time.monotonic()
        with pytest.raises(FatalStepError, match=rf"^{first}: hang: rollout actor 0 \(.*\) has run update_weights "
                                                 r"for \d+\.\d s, past watchdog.weight_push_s=3 s"):
            run(env, cfg, actors=[actor])
        assert time.monotonic() - t < 60.0
        tags = get_run(env.uri, _runs(env, name)[-1]).data.tags
        assert tags["rlray.status"] == "FAILED" and "in injected_hang" in tags["rlray.error"]
        ray.kill(actor, no_restart=True)


def test_out_of_memory_at_load_or_first_step_retries_once_smaller(env):
    from rlray.learner import PolicyLearner

    real_init, real_step = PolicyLearner.__init__, online.run_step
    calls = {"init": 0, "step": 0}

    def oom_once_at_load(self, *args, **kwargs):
        calls["init"] += 1
        if calls["init"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
        return real_init(self, *args, **kwargs)

    def oom_once_in_first_step(ctx, step):
        calls["step"] += 1
        if calls["step"] == 1:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory (injected)")
        return real_step(ctx, step)

    for name, target, fake in (("load", PolicyLearner, oom_once_at_load), ("first step", online, oom_once_in_first_step)):
        attr = "__init__" if target is PolicyLearner else "run_step"
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(target, attr, fake)
            out, run_id, _ = run(env, make_cfg(env, f"oom-{attr}", "run.max_steps=1"))
        assert out.status == "FINISHED"
        tags = get_run(env.uri, run_id).data.tags
        assert tags["rlray.oom_fallback"] == f"{name}: learner.sequences_per_microbatch 4 -> 2, model.gradient_checkpointing False -> True"
        trained = load_config_text(checkpoint.join(out.last_snapshot, "config.yaml"))
        assert (trained["learner"]["sequences_per_microbatch"], trained["model"]["gradient_checkpointing"]) == (2, True)
    assert calls["init"] >= 2 and calls["step"] == 2


def test_full_disk_keeps_the_previous_snapshot_and_alerts(env, caplog):
    root = f"faulty://{env.base}/fulldisk/snapshots"
    cfg = make_cfg(env, "fulldisk", f"checkpoint.uri={root}", "checkpoint.every_steps=1", "run.max_steps=2")
    faultyfs.FaultyFileSystem.fail_under = "step_00000002"
    try:
        out, run_id, _ = run(env, cfg)  # no monitor: alerts go straight to the log and the MLflow run
    finally:
        faultyfs.FaultyFileSystem.fail_under = None
    assert out.status == "FINISHED" and out.last_snapshot.endswith("step_00000001")
    alert = get_run(env.uri, run_id).data.tags["rlray.alert.snapshot_failed"]
    assert alert.startswith("snapshot at step 2 failed: could not write") and "No space left on device" in alert
    assert alert.endswith(f"the last complete one is {out.last_snapshot}")
    assert f"ALERT snapshot_failed: {alert}" in caplog.text
    assert series(env, run_id, "checkpoint/failures") == [(2, 1.0)]
    assert checkpoint.latest_snapshot(root) == out.last_snapshot
    # and it is usable: a run resumes from it
    again, again_id, _ = run(env, make_cfg(env, "fulldisk", f"checkpoint.uri={root}", "run.max_steps=2"),
                             resume_from=checkpoint.resolve_snapshot("latest", root))
    assert (again.status, again.step) == ("FINISHED", 2) and [s for s, _ in series(env, again_id, "learner/loss")] == [2]
