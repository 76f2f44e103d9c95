"""The ``rlray`` command line: train, check, sweep, eval, serve-reward, judge, rollback, export, models, snapshots, data,
config, plan, monitor, ledger.

Each command imports what it needs inside its function: ``rlray --help`` and ``rlray data`` start in
a second instead of paying for Ray, torch and vLLM (the one place where function-local imports are the rule).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from pathlib import Path

from rlray.cli_parser import build_parser
from rlray.config import Config, ConfigError, load_config

__all__ = ["build_parser", "main"]


def _train(args: argparse.Namespace) -> int:
    from rlray.launch.ray_setup import RayStart

    overrides = list(args.overrides) + ([f"checkpoint.resume_from={args.resume}"] if args.resume else [])
    cfg = load_config(args.config, overrides)  # a bad config or override stops here: nothing started
    ray_start = RayStart(log_to_driver=args.verbose)  # Ray comes up while the driver's modules import (issue 39)
    try:
        from rlray.launch.driver import run_training
    except BaseException:
        ray_start.cancel()
        raise
    result = run_training(cfg, verbose=args.verbose, ray_start=ray_start)
    print(json.dumps({"run_id": result.run_id, "status": result.status, "tracking_uri": result.tracking_uri,
                      "final_snapshot": result.final_snapshot, "monitor_url": result.monitor_url, "log_dir": result.log_dir,
                      **({"error": result.error} if result.error else {}), **result.startup}, indent=2))
    if result.error:
        print(f"rlray train: {result.error}", file=sys.stderr)
    return 0 if result.status in ("FINISHED", "stopped: wall_time") else 1  # the time budget spent: a planned end


def _check(args: argparse.Namespace) -> int:
    from rlray.launch.check import check_run
    from rlray.launch.driver import resolve_paths
    from rlray.plan import resolve_plan

    print(check_run(resolve_plan(resolve_paths(load_config(args.config, args.overrides)))), flush=True)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from rlray.sweep.spec import load_sweep
    from rlray.sweep.tune import run_sweep

    cfg = load_config(args.config, args.overrides)
    result = run_sweep(cfg, load_sweep(args.sweep))
    print(json.dumps({"parent_run_id": result.parent_run_id, "status": result.status, "best_run_id": result.best_run_id,
                      "tracking_uri": result.tracking_uri, "trials": [t.__dict__ for t in result.trials]}, indent=2))
    return 0 if result.status == "FINISHED" else 1


def _eval(args: argparse.Namespace) -> int:
    from rlray.launch.driver import evaluate_checkpoint

    cfg = load_config(args.config, args.overrides)
    print(json.dumps(evaluate_checkpoint(cfg, args.checkpoint), indent=2))
    return 0


def _serve_reward(args: argparse.Namespace) -> int:
    import time

    from rlray.launch.driver import init_ray, resolve_paths, start_reward_server
    from rlray.launch.judges import deploy_judges
    from rlray.plan import resolve_plan

    cfg = resolve_paths(load_config(args.config, args.overrides))
    plan = resolve_plan(cfg)
    init_ray()
    start_reward_server(plan)
    srv = cfg.reward.server
    print(f"rlray-reward version {cfg.reward.version}: POST http://{srv.host}:{srv.port}/score "
          f"(Serve application '{srv.app_name}')", flush=True)
    deploy_judges(plan)
    for judge in cfg.reward.judges:
        print(f"judge '{judge.name}' version {cfg.reward.version}: {judge.path} (Serve application '{judge.app_name}')",
              flush=True)
    if args.detach:
        return 0
    from ray import serve

    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        for name in [srv.app_name, *(j.app_name for j in cfg.reward.judges)]:
            serve.delete(name)
    return 0


def _judge(args: argparse.Namespace) -> int:
    from rlray.launch.driver import resolve_paths
    from rlray.launch.judge_check import judge_check
    from rlray.plan import resolve_plan
    from rlray.reward.judges.stats import format_report

    if args.rows < 1:
        print(f"rlray: --rows={args.rows}: give at least 1 row", file=sys.stderr)
        return 2
    plan = resolve_plan(resolve_paths(load_config(args.config, args.overrides)))
    result = judge_check(plan, args.rows, threshold=args.threshold, response_column=args.response_column,
                         label_column=args.label_column)  # fmt: skip
    if args.json:
        import dataclasses

        print(json.dumps(dataclasses.asdict(result), indent=2, default=str))
        return 0
    print(f"rlray judge check: {result.responses} responses to {result.rows} rows; references: "
          f"{', '.join(result.references) or 'none (no reward.functions or --label-column)'}")
    for report in result.reports:
        print(format_report(report))
    return 0


def _optional_config(args: argparse.Namespace) -> Config:
    """Returns the --config file's config (MLflow store, experiment, S3 options), else the defaults."""
    from rlray.config import config_from_dict
    from rlray.launch.driver import resolve_paths

    cfg = load_config(args.config, args.overrides) if args.config else config_from_dict({}, args.overrides)
    return resolve_paths(cfg)


def _rollback(args: argparse.Namespace) -> int:
    """Writes the config that resumes from the chosen snapshot: the config the snapshot was trained with, or with
    --config that config with the snapshot's trained sections (learner, algo, reward, model.gradient_checkpointing)."""
    from rlray.checkpoint import lineage
    from rlray.checkpoint.contents import adopt_trained_tree, snapshot_config
    from rlray.config import normalized_tree, resume_tree

    dest = Path(args.dest or f"rollback/{args.ref.rstrip('/').rsplit('/', 1)[-1][:16]}-{args.to}")
    cfg = _optional_config(args)
    opts = cfg.checkpoint.s3.storage_options()
    uri = lineage.find_snapshot(args.ref, args.to, lineage.Registry(cfg.tracking.mlflow_uri, cfg.tracking.experiment, opts))
    trained = snapshot_config(uri, opts)
    tree = normalized_tree(adopt_trained_tree(cfg.model_dump(), trained)) if args.config else trained
    print(json.dumps(lineage.write_rollback(uri, resume_tree(tree, uri), dest, opts), indent=2))
    return 0


def _export(args: argparse.Namespace) -> int:
    from rlray.launch.export import ExportError, export_snapshot
    from rlray.plan import resolve_plan

    try:
        plan = resolve_plan(_optional_config(args))
        print(json.dumps(export_snapshot(args.ref, args.to, plan, adapter=args.adapter), indent=2))
    except ExportError as err:
        print(f"rlray export: {err}", file=sys.stderr)
        return 2
    return 0


def _models(args: argparse.Namespace) -> int:
    from rlray.checkpoint import lineage

    cfg = _optional_config(args)
    uri, exp = cfg.tracking.mlflow_uri, args.experiment or cfg.tracking.experiment
    if args.models_command == "list":
        versions = lineage.run_versions(uri, exp, args.run) if args.run else lineage.all_versions(uri, exp)
    else:
        ref = args.version.lstrip("v")
        if not ref.isdigit():  # a run id: start from its newest version
            ref = lineage.run_versions(uri, exp, args.version)[-1]["version"]
        versions = lineage.chain(uri, exp, ref)
    print(f"{lineage.model_name(exp)} ({uri})")
    print(lineage.format_versions(versions))
    return 0


def _snapshots(args: argparse.Namespace) -> int:
    from rlray.checkpoint import storage as checkpoint

    cfg = _optional_config(args)
    opts = cfg.checkpoint.s3.storage_options()
    if args.snapshots_command == "list":
        for s in checkpoint.list_snapshots(cfg.checkpoint_uri, opts):
            print(f"{'complete  ' if s.complete else 'INCOMPLETE'}  step {s.step:>8}  {s.uri}")
        return 0
    rules = checkpoint.lifecycle_rules(cfg.checkpoint_uri, cfg.checkpoint.max_age_days, cfg.checkpoint.log_max_age_days)
    print(json.dumps(rules, indent=2))
    if args.apply:
        checkpoint.apply_lifecycle(cfg.checkpoint_uri, rules, opts)
        print(f"applied to the bucket of {cfg.checkpoint_uri}; note: S3 expiry does not spare the newest snapshot")
    return 0


def _data(args: argparse.Namespace) -> int:
    from rlray.data import fetch_dataset

    for name in args.names:
        print(f"{name}: {fetch_dataset(name, Path(args.dest))}")
    return 0


def _config(args: argparse.Namespace) -> int:
    if args.metrics_reference:
        from rlray.observe.metrics_reference import metrics_markdown

        print(metrics_markdown(), end="")
        return 0
    if args.reference:
        from rlray.config.describe import reference_markdown

        print(reference_markdown(Config), end="")
        return 0
    if args.config is None:
        print("rlray config: give a CONFIG file (or --reference, --metrics-reference for a reference page)", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)
    if args.describe:
        from rlray.config.describe import described_yaml

        print(described_yaml(cfg), end="")
    else:
        print(cfg.to_yaml(), end="")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from rlray.launch.plan import Hardware, local_gpu_memory_gib, plan_run
    from rlray.launch.plan_report import format_plan
    from rlray.plan import resolve_plan

    run = resolve_plan(load_config(args.config, args.overrides))  # the plan a run of the config uses
    hardware, gpus = None, run.uses_gpus
    if args.gpus is not None or args.gpu_memory_gib is not None or gpus:
        size = args.gpu_memory_gib or local_gpu_memory_gib()
        if size is None:
            print("rlray plan: give the GPUs' memory (--gpu-memory-gib M): no GPU is visible here", file=sys.stderr)
            return 2
        if args.gpus is None and not gpus:
            print("rlray plan: the config asks for no GPUs; give how many to plan for (--gpus N)", file=sys.stderr)
            return 2
        hardware = Hardware(args.gpus, args.nodes, size)
    plan = plan_run(run, hardware)
    print(format_plan(plan))
    return 0 if plan.fits else 1


def _monitor(args: argparse.Namespace) -> int:
    import time

    from rlray.config import monitor_defaults
    from rlray.observe.stored import StoredRun

    uri = args.tracking_uri or _optional_config(args).tracking.mlflow_uri
    run_id = args.run.removeprefix("runs:/").strip("/").split("/", 1)[0]
    try:
        stored = StoredRun(uri, run_id, refresh_s=args.refresh_s, monitor_defaults=monitor_defaults())
    except Exception as err:  # mlflow's error for a missing run or store; the message names the run and store
        print(f"rlray monitor: cannot read run {run_id!r} from {uri}: {err}", file=sys.stderr)
        return 2
    port = stored.serve(args.host, args.port)
    print(f"rlray monitor: run {run_id} ({stored.mlflow_status.lower()}) from {uri}", flush=True)
    print(f"rlray monitor: page at http://{args.host}:{port}/ (read-only; Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        stored.close()
    return 0


def _ledger(args: argparse.Namespace) -> int:
    from rlray.run import ledger

    uri = args.tracking_uri or _optional_config(args).tracking.mlflow_uri
    run_id = args.run.removeprefix("runs:/").strip("/").split("/", 1)[0]
    try:
        usage = ledger.run_usage(uri, run_id)
    except Exception as err:  # mlflow's error for a missing run or store; the message names the run and store
        print(f"rlray ledger: cannot read run {run_id!r} from {uri}: {err}", file=sys.stderr)
        return 2
    if not usage.steps_of and not usage.later_steps:
        print(f"rlray ledger: run {run_id} has no prompt ledger (ledger/step_<n>.json; offline runs keep none)",
              file=sys.stderr)
        return 2
    report, rows = ledger.check_logged_run(uri, run_id) if args.check else (None, None)
    print(f"run {run_id} ({uri}): the prompt ledger of steps 1-{usage.last_step}")
    print("\n".join(usage.lines(data_rows=rows, per_prompt=args.prompts)))
    if report is None:
        return 0
    print(report.summary())
    return 0 if report.ok else 1


HANDLERS = {"train": _train, "check": _check, "sweep": _sweep, "eval": _eval, "serve-reward": _serve_reward,
            "judge check": _judge, "rollback": _rollback, "export": _export, "models": _models, "snapshots": _snapshots,
            "config": _config, "plan": _plan, "monitor": _monitor, "ledger": _ledger, "data": _data}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rlray`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)  # a bad command line exits 2 with an `rlray <command>:` line
    # MLflow draws a progress bar per artifact download (rlray monitor, ledger): dozens of redraws before the output
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if args.command in ("train", "check"):  # a quiet console; train's full log goes to the run's folder (rlray.launch.console)
        from rlray.launch.console import configure_console

        configure_console(args.command == "train" and args.verbose)
    else:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return HANDLERS[args.handler](args)
    except Exception as err:
        if not isinstance(err, input_errors()):
            raise
        print(f"rlray: {err}", file=sys.stderr)  # bad input found before the run: the message says what to fix
        return 2


def input_errors() -> tuple[type[Exception], ...]:
    """Returns the error classes of bad input found before a run (an ``rlray:`` line and exit status 2). Imported
    when an error is raised, not at start: ``rlray data`` and ``rlray --help`` pay for no model or Ray code."""
    from rlray.checkpoint.storage import SnapshotError
    from rlray.data import DataError
    from rlray.launch.placement import PlacementError
    from rlray.launch.preflight import PreflightError
    from rlray.models import ModelError
    from rlray.reward import RewardFunctionError

    return ConfigError, SnapshotError, DataError, ModelError, PlacementError, RewardFunctionError, PreflightError


def console_main() -> None:
    """Entry point of the ``rlray`` console script and of ``python -m rlray.cli``: ``main``, then a quick exit.

    After the command's output is written: the Ray this process started (``rlray train``'s embedded one) is shut
    down here rather than by Ray's exit hook, which first sleeps 0.5 s, and every object is frozen out of the
    interpreter's last garbage collection (``gc.freeze``), which otherwise scans torch's, transformers' and MLflow's
    objects at exit: 2-4 s on a 2-core machine (py-spy --native of ``rlray train``: ``gc_collect_main`` after the
    JSON summary; issue 39). Exit hooks and module finalizers still run. ``main`` itself stays free of both, for
    callers in a longer-lived process (tests, notebooks).

    Raises:
        SystemExit: always, with ``main``'s exit status.
    """
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if (ray := sys.modules.get("ray")) is not None and ray.is_initialized():
        ray.shutdown()
    gc.freeze()
    sys.exit(status)


if __name__ == "__main__":
    console_main()
