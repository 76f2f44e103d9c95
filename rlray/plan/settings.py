"""The types of the settings a ``RunPlan`` hands out read-only (``RunPlan.settings``): the validated config and
its sections, under the plan's names.

The run reads these sections as they are (algorithm hyper-parameters, optimizer, ``data.*``, ``eval.*``,
``guard.*``, ``run.*``, ``offline.*``); its decisions are the plan's records (``rlray.plan.records``). Rooms below
the CLI annotate with these names, so that only ``rlray.plan`` imports ``rlray.config`` (tests/test_architecture.py,
issue 38). The classes stay in ``rlray.config``: ``AlgoConfig`` resolves ``algo.name`` through the algorithm
registry, which imports torch, so they cannot move below it; nothing may assign to them (a change makes a new plan,
``rlray.plan.replan``).
"""

from rlray.config import Config as Settings
from rlray.config import GuardConfig as GuardSettings

__all__ = ["GuardSettings", "Settings"]
