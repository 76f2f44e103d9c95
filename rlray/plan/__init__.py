"""The run plan: a validated config resolved once into frozen, typed records (``resolve_plan`` -> ``RunPlan``).

It sits below ``rlray.launch`` and ``rlray.run`` and above the building blocks; the driver, the preflight,
``rlray plan``, the placement check, ``rlray.run.build`` and rank 0's lead read its fields instead of deciding again.

``ConfigError`` is re-exported: the plan's functions raise it, and the run raises it for a bad setting it reads
from ``RunPlan.settings`` (one error class for a bad config, whichever room finds it).
"""

from rlray.config.base import ConfigError
from rlray.plan.records import (
    Deadlines,
    Engines,
    Episodes,
    Judge,
    Lengths,
    Parallelism,
    RewardTerms,
    RoleResources,
    Roles,
    RunPlan,
    Sampling,
    Snapshots,
    Tracking,
)
from rlray.plan.resolve import compute_dtype, plan_from_tree, replan, resolve_plan

__all__ = [
    "Deadlines", "Engines", "Episodes", "Judge", "Lengths", "Parallelism", "RewardTerms", "RoleResources", "Roles", "RunPlan",
    "Sampling",
    "Snapshots", "Tracking", "compute_dtype", "resolve_plan", "plan_from_tree", "replan", "ConfigError",
]  # fmt: skip
