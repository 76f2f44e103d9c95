"""Rollout: the RolloutEngine over vLLM (transformers generate as a fallback).

Importing this package does not import vLLM; the engine imports it when backend="vllm" starts.
"""

from rlray.rollout.engine import RolloutEngine
from rlray.rollout.types import Completion, RolloutSource, SamplingSpec

__all__ = ["Completion", "RolloutEngine", "RolloutSource", "SamplingSpec"]
