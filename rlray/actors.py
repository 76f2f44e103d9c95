"""Thin Ray actors over rlray's plain classes. Each remote method delegates in a few lines."""

from __future__ import annotations

import ray
import torch

from rlray.config import Config
from rlray.rollout import Completion, RolloutEngine, SamplingSpec


class RolloutActor:
    """Ray actor around a ``RolloutEngine`` (one vLLM engine per actor).

    Args:
        model_path: local Hugging Face folder of the initial policy.
        engine_kwargs: keyword arguments of ``RolloutEngine`` (dtype, seed, backend, ...).
    """

    def __init__(self, model_path: str, engine_kwargs: dict) -> None:
        self.engine = RolloutEngine(model_path, **engine_kwargs)

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec) -> list[Completion]:
        """Returns ``sampling.n`` completions per prompt, prompt-major (see ``RolloutEngine.generate``)."""
        return self.engine.generate(prompt_token_ids, sampling)

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> int:
        """Loads new policy weights, resets the cache, and returns the new policy version."""
        self.engine.update_weights(named_tensors, version)
        return self.engine.policy_version

    def policy_version(self) -> int:
        """Returns the policy version the engine generates with."""
        return self.engine.policy_version

    def ready(self) -> bool:
        """Returns True once the engine is built (used to wait for start-up)."""
        return True


def rollout_engine_kwargs(cfg: Config, max_model_len: int) -> dict:
    """Returns ``RolloutEngine`` keyword arguments from the config (plain values only)."""
    return {
        "dtype": cfg.model.dtype,
        "seed": cfg.run.seed,
        "max_model_len": max_model_len,
        "backend": cfg.rollout.backend,
        "enforce_eager": cfg.rollout.enforce_eager,
        "kv_cache_gib": cfg.rollout.kv_cache_gib,
        "gpu_memory_utilization": cfg.rollout.gpu_memory_utilization,
        "cpu_threads": cfg.resources.rollout_cpu_threads,
    }


def start_rollout_actors(
    cfg: Config, model_path: str, max_model_len: int, namespace: str | None = None
) -> list[ray.actor.ActorHandle]:
    """Returns ``resources.rollout.num_workers`` started rollout actors, named ``rlray:rollout-<i>``.

    Blocks until each engine is built, so start-up errors surface here. ``namespace`` (the run's
    own, from the driver) keeps the names of concurrent runs on one cluster (sweep trials) apart.
    The actors never join a placement group of the caller (a Tune trial's captures its children).
    """
    res = cfg.resources.rollout
    cls = ray.remote(RolloutActor)
    actors = [
        cls.options(
            name=f"rlray:rollout-{i}", namespace=namespace, num_cpus=res.cpus, num_gpus=res.gpus, scheduling_strategy="DEFAULT"
        ).remote(
            model_path, rollout_engine_kwargs(cfg, max_model_len)
        )
        for i in range(res.num_workers)
    ]
    ray.get([a.ready.remote() for a in actors])
    return actors
