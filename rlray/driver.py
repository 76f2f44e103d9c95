"""The driver: starts Ray, the rollout actors and the Ray Train learner group, and owns the MLflow run.

``rlray train``, ``jobs/train.py`` and sweeps call ``run_training``. The step loop itself runs inside
the Ray Train training function (``rlray.loop.train_worker``); this module only wires it up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import ray

from rlray.actors import start_rollout_actors
from rlray.config import Config
from rlray.hooks import StepHook, StopWhenRequested, start_run_control
from rlray.models import resolve_model_path
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
    # Inside `ray job submit` the job's runtime_env already applies, and Ray refuses a ray.init
    # runtime_env that sets one of its env vars again: add only what the job leaves unset.
    if job_json := os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        job_env = (json.loads(job_json).get("runtime_env") or {}).get("env_vars") or {}
        env = {k: v for k, v in env.items() if k not in job_env}
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
    for fn in out.reward.functions:
        target, name = fn.path.rsplit(":", 1) if ":" in fn.path else (fn.path, "")
        if target.endswith(".py"):
            fn.path = f"{local(target)}:{name}"
    return out


def max_model_len(cfg: Config) -> int:
    """Returns the engine's context length: longest prompt plus the longest generation, in tokens."""
    return cfg.data.max_prompt_tokens + max(cfg.rollout.max_new_tokens, cfg.eval_max_new_tokens)


def run_training(
    cfg: Config, *, step_hooks: Sequence[StepHook] = (), tags: dict[str, str] | None = None
) -> TrainResult:
    """Runs a whole training job and returns its result.

    SIGTERM (``ray job stop``) on the driver's main thread asks the loop to stop at the next step
    boundary; the run then ends with its final snapshot and the MLflow status KILLED.

    Args:
        cfg: the validated config.
        step_hooks: extra per-step hooks run on learner rank 0 (``rlray.hooks``; Tune's reporter).
        tags: extra MLflow tags of the run (a sweep sets ``mlflow.parentRunId``).

    Raises:
        ray.train.TrainingFailedError: a learner worker failed (the MLflow run is marked FAILED).
    """
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from rlray.loop import train_worker

    init_ray()
    cfg = resolve_paths(cfg)
    model_dir = resolve_model_path(cfg.model.path)
    tracker = Tracker(cfg.tracking.mlflow_uri, cfg.tracking.experiment, run_name=cfg.run.name)
    tracker.log_config(cfg)
    tracker.set_tags({"rlray.model_dir": model_dir, "rlray.output_dir": cfg.run.output_dir, **(tags or {})})
    log.info("MLflow run %s in %s", tracker.run_id, cfg.tracking.mlflow_uri)
    actors = []
    status = "FAILED"
    control = start_run_control()
    try:
        actors = start_rollout_actors(cfg, model_dir, max_model_len(cfg), namespace=f"rlray-{tracker.run_id}")
        res = cfg.resources.learner
        trainer = TorchTrainer(
            train_worker,
            train_loop_config={
                "config": cfg.model_dump(mode="json"),
                "model_dir": model_dir,
                "rollout_actors": actors,
                "run_id": tracker.run_id,
                "step_hooks": [StopWhenRequested(control), *step_hooks],
            },
            scaling_config=ScalingConfig(
                num_workers=res.num_workers,
                use_gpu=res.gpus > 0,
                resources_per_worker={"CPU": res.cpus, **({"GPU": res.gpus} if res.gpus else {})},
            ),
            run_config=RunConfig(name=f"rlray-{tracker.run_id[:12]}", storage_path=f"{cfg.run.output_dir}/ray_train"),
        )
        with stop_on_sigterm(control):
            trainer.fit()
        stop_reason = ray.get(control.stop_reason.remote())
        if stop_reason:
            tracker.set_tags({"rlray.stop_reason": stop_reason})
        status = "KILLED" if stop_reason else "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracker.finish(status)
        for a in [*actors, control]:
            ray.kill(a)
    return TrainResult(tracker.run_id, cfg.tracking.mlflow_uri, f"{cfg.run.output_dir}/final", status)


@contextlib.contextmanager
def stop_on_sigterm(control: ray.actor.ActorHandle) -> Iterator[None]:
    """Within the block, SIGTERM asks the run to stop at its next step boundary (main thread only).

    ``ray job stop`` sends SIGTERM to the job's entry process and SIGKILLs it after
    ``RAY_JOB_STOP_WAIT_TIME_S`` (3 s by default; jobs/runtime_env.yaml raises it): the step in
    flight, the final snapshot and the MLflow status must fit in that grace period. A second
    SIGTERM stops at once (KeyboardInterrupt, MLflow status KILLED). Off the main thread (a Tune
    trial), signals cannot be handled and the block runs unchanged. The previous handler is
    restored on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = 0

    def handler(signum: int, frame: object) -> None:
        nonlocal received
        received += 1
        if received > 1:
            raise KeyboardInterrupt(f"signal {signum} received twice")
        log.warning("SIGTERM: stopping at the next step boundary (send it again to stop at once)")
        control.request_stop.remote("SIGTERM")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
    from rlray.loop import build_scorer, rollout, score
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
    actors = start_rollout_actors(one, model_dir, max_model_len(cfg))
    try:
        sampling = SamplingSpec(n=1, max_new_tokens=cfg.eval_max_new_tokens, temperature=0.0, top_p=1.0)
        completions = rollout(actors, ids, sampling)
        got = score(build_scorer(cfg), rows, completions, tokenizer)
    finally:
        for a in actors:
            ray.kill(a)
    n = len(completions)
    return {
        "eval/accuracy": sum(got["accuracy"]) / n,
        "eval/format_rate": sum(got["format"]) / n,
        "eval/num_problems": float(n),
    }
