"""The driver: starts Ray, checks the resources, starts every role and owns the MLflow run.

``rlray train``, ``jobs/train.py`` and sweeps call ``run_training``. The step loop itself runs inside
the Ray Train training function (``rlray.loop.train_worker``); this module only wires it up:

1. check that every role's resources fit the cluster (before any actor starts),
2. the rollout actors in their placement group (rlray:rollout-<i>),
3. the reward Serve application rlray-reward (when reward.server.enabled),
4. the reference actor rlray:reference-0 (when resources.reference.placement == "actor"),
5. the Ray Train TorchTrainer (DDP or FSDP over resources.learner.num_workers workers).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.placement_group import remove_placement_group

from rlray.actors import kill_actors, start_reference_actor, start_rollout_actors
from rlray.config import Config
from rlray.models import resolve_model_path
from rlray.placement import check_cluster, rollout_placement_group
from rlray.tracking import Tracker, resolve_tracking_uri

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """Outcome of a run: the MLflow run id, the resolved tracking URI and the final snapshot URI."""

    run_id: str
    tracking_uri: str
    final_snapshot: str
    status: str


def init_ray(*, include_dashboard: bool | None = None) -> None:
    """Connects to the cluster in RAY_ADDRESS, or starts an embedded local Ray (bound to 127.0.0.1)."""
    if ray.is_initialized():
        return
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0")}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env})
    else:
        ray.init(include_dashboard=include_dashboard, dashboard_host="127.0.0.1", runtime_env={"env_vars": env})


def resolve_paths(cfg: Config, base: Path | None = None) -> Config:
    """Returns a copy of ``cfg`` with local relative paths made absolute against ``base`` (cwd).

    Ray workers and jobs can run in another folder than the shell that started the run, so the
    driver pins the MLflow store, the output folder and local data files once.
    """
    base = base or Path.cwd()
    out = cfg.model_copy(deep=True)
    out.tracking.mlflow_uri = resolve_tracking_uri(cfg.tracking.mlflow_uri, base)

    def local(p: str) -> str:
        return p if "://" in p or Path(p).is_absolute() or not (base / p).exists() else str((base / p).resolve())

    if "://" not in cfg.run.output_dir:
        out.run.output_dir = str((base / cfg.run.output_dir).resolve())
    out.data.train_files = [local(p) for p in cfg.data.train_files]
    out.data.eval_files = [local(p) for p in cfg.data.eval_files]
    out.model.path = local(cfg.model.path)
    out.offline.pairs_files = [local(p) for p in cfg.offline.pairs_files]
    for section in (out.reward, out.critic):
        if section.model_path is not None:
            section.model_path = local(section.model_path)
    for fn in out.reward.functions:
        target, name = fn.path.rsplit(":", 1) if ":" in fn.path else (fn.path, "")
        if target.endswith(".py"):
            fn.path = f"{local(target)}:{name}"
    return out


def max_model_len(cfg: Config) -> int:
    """Returns the engine's context length: longest prompt plus the longest generation, in tokens."""
    return cfg.data.max_prompt_tokens + max(cfg.rollout.max_new_tokens, cfg.eval_max_new_tokens)


def start_reward_server(cfg: Config) -> bool:
    """Deploys (or updates in place) the reward Serve application of ``cfg`` and waits until it serves.

    Serve's HTTP proxy binds reward.server.host:port (127.0.0.1 by default); ``POST /score`` works
    for outside tools. Deploying again with a new reward.version hot-swaps the scorer.

    Returns:
        True when this call created the application, False when it updated a running one.
    """
    from ray import serve

    from rlray.loop import scorer_kwargs
    from rlray.reward.server import build_reward_app, deploy_reward_app

    srv, res = cfg.reward.server, cfg.resources.reward
    existed = srv.app_name in serve.status().applications  # empty when Serve has not started
    app = build_reward_app(
        scorer_kwargs=scorer_kwargs(cfg),
        version=cfg.reward.version,
        replicas=res.replicas,
        cpus=res.cpus,
        gpus=res.gpus,
        max_batch_size=srv.max_batch_size,
        batch_wait_timeout_s=srv.batch_wait_timeout_s,
        timeout_s=srv.timeout_s,
    )
    deploy_reward_app(app, name=srv.app_name, host=srv.host, port=srv.port)
    return not existed


def learner_trainer(cfg: Config, loop_config: dict):
    """Returns the Ray Train TorchTrainer of the learner group (resources.learner, placement strategy)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from rlray import loop, offline

    res = cfg.resources.learner
    # offline methods train on preference pairs: no rollout actors, their own step loop
    return TorchTrainer(
        loop.train_worker if cfg.algo.family == "online" else offline.train_worker,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(
            num_workers=res.num_workers,
            use_gpu=res.gpus > 0,
            resources_per_worker={"CPU": res.cpus, **({"GPU": res.gpus} if res.gpus else {})},
            placement_strategy=cfg.resources.placement_strategy,
        ),
        run_config=RunConfig(
            name=f"rlray-learner-{loop_config['run_id'][:12]}", storage_path=f"{cfg.run.output_dir}/ray_train"
        ),
    )


def run_training(cfg: Config) -> TrainResult:
    """Runs a whole training job and returns its result.

    Raises:
        rlray.placement.PlacementError: the resources do not fit the cluster (nothing was started).
        ray.train.TrainingFailedError: a learner worker failed (the MLflow run is marked FAILED).
    """
    init_ray()
    cfg = resolve_paths(cfg)
    check_cluster(cfg)
    model_dir = resolve_model_path(cfg.model.path)
    tracker = Tracker(cfg.tracking.mlflow_uri, cfg.tracking.experiment, run_name=cfg.run.name)
    tracker.log_config(cfg)
    tracker.set_tags({"rlray.model_dir": model_dir, "rlray.output_dir": cfg.run.output_dir})
    log.info("MLflow run %s in %s", tracker.run_id, cfg.tracking.mlflow_uri)
    actors, reference, pg, own_app = [], None, None, False
    status = "FAILED"
    try:
        if cfg.algo.family == "online":
            pg = rollout_placement_group(cfg)
            actors = start_rollout_actors(cfg, model_dir, max_model_len(cfg), pg)
        if cfg.reward.server.enabled and cfg.algo.family == "online":
            own_app = start_reward_server(cfg)
        if cfg.algo.family == "online" and cfg.algo.kl_coef > 0 and cfg.resources.reference.placement == "actor":
            reference = start_reference_actor(cfg, model_dir)
        trainer = learner_trainer(cfg, {
            "config": cfg.model_dump(mode="json"),
            "model_dir": model_dir,
            "rollout_actors": actors,
            "reference_actor": reference,
            "run_id": tracker.run_id,
        })
        trainer.fit()
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracker.finish(status)
        kill_actors(actors + ([reference] if reference else []))
        if pg is not None:
            remove_placement_group(pg)
        if own_app:  # a server started by `rlray serve-reward` before the run stays up
            from ray import serve

            serve.delete(cfg.reward.server.app_name)
    return TrainResult(tracker.run_id, cfg.tracking.mlflow_uri, f"{cfg.run.output_dir}/final", status)


def evaluate_checkpoint(cfg: Config, checkpoint: str) -> dict[str, float]:
    """Returns greedy eval metrics of a snapshot (or any model path) on ``data.eval_files``.

    Starts one rollout actor on the checkpoint's model and scores the first ``eval.num_problems``
    problems exactly as training's eval does.

    Raises:
        rlray.checkpoint.SnapshotError: ``checkpoint`` is an incomplete snapshot.
        ValueError: ``eval.num_problems`` is 0.
    """
    from rlray.checkpoint import local_model_dir
    from rlray.data import load_prompt_rows, prepare_prompts
    from rlray.fleet import RolloutFleet
    from rlray.loop import build_scorer, rollout, score
    from rlray.reward.server import LocalRewardClient
    from rlray.models import load_tokenizer
    from rlray.rollout import SamplingSpec

    if cfg.eval.num_problems == 0:
        raise ValueError("eval.num_problems=0: set eval.num_problems>=1 to evaluate")
    init_ray(include_dashboard=False)
    cfg = resolve_paths(cfg)
    is_snapshot = Path(checkpoint, "manifest.json").exists() or "://" in checkpoint
    model_dir = local_model_dir(checkpoint) if is_snapshot else resolve_model_path(checkpoint)
    tokenizer = load_tokenizer(model_dir, cfg.model.chat_template)
    rows = load_prompt_rows(cfg.data.eval_files)[: cfg.eval.num_problems]
    rows, ids, _ = prepare_prompts(
        rows, tokenizer, max_prompt_tokens=10**9, instruction=cfg.data.instruction, system_prompt=cfg.data.system_prompt
    )
    one = cfg.model_copy(deep=True)
    one.resources.rollout.num_workers = 1
    one.resources.rollout.cpu_threads = None  # this node's cores, all to the one actor
    actors = start_rollout_actors(one, model_dir, max_model_len(cfg))
    try:
        sampling = SamplingSpec(n=1, max_new_tokens=cfg.eval_max_new_tokens, temperature=0.0, top_p=1.0)
        completions = rollout(RolloutFleet(actors), ids, sampling)
        got = score(LocalRewardClient(build_scorer(cfg), cfg.reward.version), rows, completions, tokenizer).values
    finally:
        kill_actors(actors)
    n = len(completions)
    return {
        "eval/accuracy": sum(got["accuracy"]) / n,
        "eval/format_rate": sum(got["format"]) / n,
        "eval/num_problems": float(n),
    }
