"""rlray.launch.ray_setup on the session's Ray (one node, started by this test process): the Ray Train helpers that
``LearnerTrainer`` leaves out, and the scaling policy it hands the controller."""

from __future__ import annotations

import pytest
from ray.train import RunConfig, ScalingConfig
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

from rlray.launch.ray_setup import owns_single_node_ray
from rlray.launch.trainer import LearnerTrainer, _NoAutoscalerFixedPolicy

pytestmark = pytest.mark.ray


def _trainer(tmp_path) -> LearnerTrainer:
    return LearnerTrainer(lambda config: None, scaling_config=ScalingConfig(num_workers=1),
                          run_config=RunConfig(name="t", storage_path=str(tmp_path)))


def test_the_session_ray_is_a_single_node_this_process_started(ray_session):
    assert owns_single_node_ray()


def test_on_its_own_one_node_ray_the_trainer_starts_no_cleaner_no_dataset_manager(ray_session, tmp_path):
    names = {type(cb).__name__ for cb in _trainer(tmp_path)._create_default_callbacks()}
    assert not names & {"PlacementGroupCleanerCallback", "DatasetsCallback"}, names
    assert "AcceleratorSetupCallback" in names or "BackendSetupCallback" in names, names  # Ray Train's own remain


def test_the_controller_gets_a_fixed_policy_without_autoscaler_requests(ray_session, tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(LearnerTrainer.__mro__[1], "_initialize_and_run_controller",
                        lambda self, **kwargs: seen.update(kwargs))
    scaling = ScalingConfig(num_workers=1)
    _trainer(tmp_path)._initialize_and_run_controller(scaling_policy=FixedScalingPolicy(scaling), other=1)
    policy = seen["scaling_policy"]
    assert type(policy) is _NoAutoscalerFixedPolicy and policy.scaling_config is scaling and seen["other"] == 1
    policy.after_controller_start(None)  # no coordinator actor asked for
    assert policy._coordinator_client is None
    assert policy.make_decision_for_non_running_worker_group().num_workers == 1  # the fixed size, as before


def test_a_ray_started_off_the_main_thread_outlives_its_start(tmp_path):
    """``RayStart`` (``rlray train``'s start beside the driver's imports): Ray's processes are started with
    PR_SET_PDEATHSIG, which fires when the starting *thread* ends; the cluster must keep serving after the start."""
    import subprocess
    import sys

    script = (
        "import time, ray\n"
        "from rlray.launch.ray_setup import RayStart\n"
        "info = RayStart(log_to_driver=False, include_dashboard=False).result()\n"
        "time.sleep(3)\n"  # the start's work is long done here
        "print('sum', ray.get(ray.remote(lambda a, b: a + b).remote(2, 3), timeout=60), flush=True)\n"
        "print('logs', info.logs_dir.endswith('/logs'))\n"
        "ray.shutdown()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                         env={**__import__("os").environ, "RAY_ADDRESS": ""}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sum 5" in out.stdout and "logs True" in out.stdout, out.stdout
