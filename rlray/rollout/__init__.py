"""Rollout: the RolloutEngine over vLLM (transformers generate as a fallback).

Importing this package imports neither vLLM nor torch: its records (``rlray.rollout.types``) are plain Python, and
``RolloutEngine`` (torch, transformers) is imported on first use (PEP 562). Light processes that only move
completions (the fleet, the pipeline, fake actors in tests, environment hosts) so start in about a second instead of
the ~7 s of CPU that torch, transformers and scikit-learn (through transformers' generation) cost at import.
"""

from typing import TYPE_CHECKING, Any

from rlray.rollout.types import Completion, RolloutSource, SamplingSpec

if TYPE_CHECKING:
    from rlray.rollout.engine import RolloutEngine

__all__ = ["Completion", "RolloutEngine", "RolloutSource", "SamplingSpec"]


def __getattr__(name: str) -> Any:
    """Imports ``RolloutEngine`` on first use (PEP 562); any other missing name raises AttributeError."""
    if name == "RolloutEngine":
        from rlray.rollout.engine import RolloutEngine

        return RolloutEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
