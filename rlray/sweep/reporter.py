"""The step hook that relays a trial's steps to Tune (``TuneStepReporter``), in a module of its own.

The hook travels to Ray Train's controller and learner ranks inside ``WorkerArgs``: every process that unpickles it
imports its module. Here it imports only ``rlray.run.hooks``; in ``rlray.sweep.tune`` it made each trial's
``TrainController`` import the driver (torch, transformers, MLflow, vLLM's wrappers: ~5 s of CPU per trial,
measured with ``PYTHONPROFILEIMPORTTIME=1`` on a 2-trial sweep).
"""

from __future__ import annotations

from typing import Any

from rlray.run.hooks import StepEnd


class TuneStepReporter:
    """Per-step observer hook (rank 0, after the step's snapshot): hands the step to the trial function
    and waits for Tune.

    It puts ``({"step": n, **metrics}, snapshot URI or None)`` on ``results`` and blocks on ``acks``
    until the trial function's ``tune.report`` returned, that is until the scheduler let the trial go
    on. A trial the scheduler stops (ASHA) or restarts (a PBT exploit) therefore never starts another
    step. It never asks the run to stop.

    Args:
        results: ``ray.util.queue.Queue`` the trial function reads.
        acks: ``ray.util.queue.Queue`` the trial function puts one item on per relayed result.
    """

    after_snapshot = True  # rlray.run.hooks: runs after the step's snapshot and sees its URI

    def __init__(self, results: Any, acks: Any) -> None:
        self.results = results
        self.acks = acks

    def __call__(self, event: StepEnd) -> None:
        self.results.put(({"step": event.step, **event.metrics}, event.snapshot))
        self.acks.get()
        return None
