"""``resolve_paths``: a validated config with its paths made absolute, its dtype resolved and its Hub models pinned.

The driver (``rlray.launch.driver``), ``rlray check``, ``rlray judge check``, ``rlray serve-reward`` and sweeps call
it once, before the plan is resolved (``resolve_plan(resolve_paths(cfg))``): Ray workers and jobs may run in another
folder than the shell that started the run, and every role then reads the same local files and model folders. It
edits the config, so it lives beside ``resolve_plan``, the config's reader (issue 38).
"""

from __future__ import annotations

from pathlib import Path

from rlray.config import Config
from rlray.plan.hub import pin_hub_models
from rlray.plan.resolve import compute_dtype


def resolve_paths(cfg: Config, base: Path | None = None) -> Config:
    """Returns a copy of ``cfg`` with local relative paths made absolute against ``base`` (cwd), and
    ``model.dtype=auto`` resolved on this machine (``rlray.plan.compute_dtype``), and Hub ids of models replaced by their
    local snapshot folders, fetched once here (``rlray.plan.hub.pin_hub_models``).

    Ray workers and jobs can run in another folder than the shell that started the run, so the
    driver pins the MLflow store, the output, snapshot and TensorBoard folders, and local data files once; the
    dtype is pinned too, so MLflow's params say which one ran.

    Raises:
        rlray.models.ModelError: a Hub id of a model cannot be had (``pin_hub_models``).
    """
    # deferred, and from the store's module, which imports no MLflow: the plan's other readers (light processes) and
    # the driver before Ray starts (issue 39) never need MLflow
    from rlray.observe.tracking_store import resolve_tracking_uri

    base = base or Path.cwd()
    out = cfg.model_copy(deep=True)
    out.model.dtype = compute_dtype(cfg)
    out.tracking.mlflow_uri = resolve_tracking_uri(cfg.tracking.mlflow_uri, base)

    def local(p: str) -> str:
        return p if "://" in p or Path(p).is_absolute() or not (base / p).exists() else str((base / p).resolve())

    if "://" not in cfg.run.output_dir:
        out.run.output_dir = str((base / cfg.run.output_dir).resolve())
    if cfg.tracking.tensorboard_dir and "://" not in cfg.tracking.tensorboard_dir:
        out.tracking.tensorboard_dir = str((base / cfg.tracking.tensorboard_dir).resolve())
    if cfg.checkpoint.uri and "://" not in cfg.checkpoint.uri:
        out.checkpoint.uri = str((base / cfg.checkpoint.uri).resolve())
    ref = cfg.checkpoint.resume_from
    if ref and ref != "latest" and "://" not in ref:
        out.checkpoint.resume_from = str((base / ref).resolve())
    out.data.train_files = [local(p) for p in cfg.data.train_files]
    out.data.eval_files = [local(p) for p in cfg.data.eval_files]
    out.model.path = local(cfg.model.path)
    if cfg.model.adapter_path is not None:
        out.model.adapter_path = local(cfg.model.adapter_path)
    if cfg.teacher.path is not None:
        out.teacher.path = local(cfg.teacher.path)
    out.offline.pairs_files = [local(p) for p in cfg.offline.pairs_files]
    for section in (out.reward, out.critic):
        if section.model_path is not None:
            section.model_path = local(section.model_path)
    for judge in out.reward.judges:
        judge.path = local(judge.path)
    for fn in out.reward.functions:
        target, name = fn.function.rsplit(":", 1) if ":" in fn.function else (fn.function, "")
        if target.endswith(".py"):
            fn.function = f"{local(target)}:{name}"
    for env_name, spec in cfg.env.environments.items():
        target, name = spec.rsplit(":", 1)
        if target.endswith(".py"):
            out.env.environments[env_name] = f"{local(target)}:{name}"
    for agent_name, spec in cfg.env.agents.items():
        target, name = spec.rsplit(":", 1)
        if target.endswith(".py"):
            out.env.agents[agent_name] = f"{local(target)}:{name}"
    for server in out.env.mcp_servers:  # a stdio MCP server's file arguments (the hosts may run in another folder)
        if server.command:
            server.command = [server.command[0], *(local(a) for a in server.command[1:])]
    for i, spec in enumerate(cfg.run.hooks):
        target, name = spec.rsplit(":", 1)
        if target.endswith(".py"):
            out.run.hooks[i] = f"{local(target)}:{name}"
    return pin_hub_models(out)
