"""Ray Train's trainer for the learner group: ``LearnerTrainer``, ``TorchTrainer`` without the helper actors a run of
rlray never uses.

Apart from ``rlray.launch.ray_setup`` so that the driver imports Ray Train only once Ray has started and the learner
group is built (issue 39: ``ray.train``'s import is ~0.6-0.8 s of CPU on the serial path before ``ray.init``).
"""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

from rlray.launch.ray_setup import owns_single_node_ray


class _NoAutoscalerFixedPolicy(FixedScalingPolicy):
    """Ray Train's fixed-size scaling policy without its resource requests to the ``AutoscalingCoordinator``.

    The requests tell an autoscaler which nodes the worker group needs; a Ray of one node this process started has
    no autoscaler, so they would only start the coordinator actor (a worker process and Ray Data's imports) and
    send it a request every 20 s. Source: ray.train.v2 ``ScalingPolicy`` (Ray 2.60), whose autoscaling methods are
    the ones overridden here.
    """

    def after_controller_start(self, train_run_context: Any) -> None:
        return None

    async def before_controller_shutdown(self) -> None:
        return None

    def before_controller_abort(self) -> None:
        return None

    def _maybe_send_resource_request(self) -> None:
        return None

    def _send_resource_request(self) -> None:
        return None

    def _cancel_resource_request(self) -> None:
        return None


class LearnerTrainer(TorchTrainer):
    """Ray Train's ``TorchTrainer`` without the helper actors a run of rlray never uses.

    - Ray Data's ``DatasetManager`` actor, when it is handed no datasets: Ray Train 2.x starts it at every learner
      group start, datasets or not (its ``DatasetsCallback``); rlray's learner reads its rows from the driver's
      object refs, never from Ray Data, so that actor would only cost a worker process and Ray Data's imports at
      each start and restart (about 2 s of CPU, ``benchmarks/startup.py``). With datasets the callback stays.
    - On a Ray of one node that this process started (``owns_single_node_ray``: ``rlray train`` without
      ``RAY_ADDRESS``, a test session): the ``PlacementGroupCleaner`` actor, which removes the learner group's
      placement group should the controller die while the job lives on (on such a Ray the job ends with the
      driver, which takes the placement group with it), and the autoscaler's resource requests
      (``_NoAutoscalerFixedPolicy``). Each is a worker process and Ray's imports: 2-3 s of CPU per learner start,
      measured with ``PYTHONPROFILEIMPORTTIME=1`` on a 2-step tiny run. A cluster keeps both.

    Source: ray.train.v2 ``DataParallelTrainer._create_default_callbacks`` and ``fit`` (Ray 2.60); callbacks are
    found by their class names, so a Ray that renames them keeps them.
    """

    def _create_default_callbacks(self) -> list[Any]:
        callbacks = super()._create_default_callbacks()
        drop = set() if self.datasets else {"DatasetsCallback"}
        if owns_single_node_ray():
            drop.add("PlacementGroupCleanerCallback")
        return [cb for cb in callbacks if type(cb).__name__ not in drop]

    def _initialize_and_run_controller(self, **kwargs: Any) -> Any:
        policy = kwargs.get("scaling_policy")
        if type(policy) is FixedScalingPolicy and owns_single_node_ray():
            kwargs["scaling_policy"] = _NoAutoscalerFixedPolicy(policy.scaling_config)
        return super()._initialize_and_run_controller(**kwargs)
