"""rlray.launch.driver.eval_setup: what it checks before it starts anything (the benchmark runs the real thing), and
its fleet's deadlines on fake rollout actors (real Ray actors, an injected hang)."""

import time

import pytest

from rlray.config import config_from_dict
from rlray.launch.driver import eval_setup, evaluate_checkpoint


def test_zero_problems_is_refused_before_ray_starts(monkeypatch):
    monkeypatch.setattr("rlray.launch.driver.init_ray", lambda **_: pytest.fail("Ray started"))
    cfg = config_from_dict({"eval": {"num_problems": 0}})
    with pytest.raises(ValueError, match="eval.num_problems=0"), eval_setup(cfg, "tiny-random"):
        pass
    with pytest.raises(ValueError, match="eval.num_problems=0"):
        evaluate_checkpoint(cfg, "tiny-random")


@pytest.mark.ray
@pytest.mark.parametrize("on_hang", ["restart", "stop"])
def test_rlray_evals_fleet_reports_a_hung_generate_as_a_runs_does(ray_session, tmp_path, caplog, on_hang):
    """`rlray eval`'s fleet (``eval_fleet``) has the plan's deadlines: a generate that sleeps 600 s under
    watchdog.engine_call_s=3 s is reported within the deadline plus a few seconds with the stuck actor's stack (the
    `rlray: hang` line and a `hang` alert to monitor.alerts' log sink), then restart (its prompts run once more on the
    other actor) or stop (HangError ends the command)."""
    import ray

    from rlray.hangs import HangError
    from rlray.launch.driver import eval_fleet
    from rlray.plan import resolve_plan
    from tests.rollout.test_fleet import SAMPLING, FakeRolloutActor

    cfg = config_from_dict({}, ["watchdog.engine_call_s=3", f"watchdog.on_hang={on_hang}"])  # monitor.alerts: log, mlflow
    cls = ray.remote(FakeRolloutActor).options(num_cpus=0.01, max_restarts=1, max_task_retries=0)
    actors = [cls.remote(), cls.remote()]
    try:
        assert ray.get([a.policy_version.remote() for a in actors]) == [0, 0]
        fleet = eval_fleet(resolve_plan(cfg), actors)
        flag = tmp_path / "hang"
        flag.touch()
        ray.get(actors[1].arm_hang.remote(str(flag)))
        prompts = [[5000 + i] for i in range(4)]
        t0 = time.monotonic()
        if on_hang == "stop":
            with pytest.raises(HangError, match=r"hang: rollout actor 1 .* has run generate for [\d.]+ s, past "
                                                r"watchdog\.engine_call_s=3 s; stopping the run[\s\S]*in injected_hang"):
                fleet.generate(prompts, SAMPLING)
        else:
            out = fleet.generate(prompts, SAMPLING)
            assert sorted(c.response_token_ids[0] for c in out) == sorted(5000 + i for i in range(4) for _ in range(3))
            assert (fleet.watch.restarts, fleet.rerun_prompts) == (1, 2)
        assert time.monotonic() - t0 < 3.0 + 20.0  # the deadline plus the report on a loaded 2-core machine
        assert fleet.watch.hangs == 1
        alerts = [r.message for r in caplog.records if r.message.startswith("ALERT hang: hang: rollout actor 1 (")]
        assert len(alerts) == 1 and "past watchdog.engine_call_s=3 s" in alerts[0]
        assert "in injected_hang" in alerts[0]  # the stack, from the stuck process
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
