"""The ``rlray`` command line: train, check, sweep, eval, serve-reward, judge, rollback, export, models, snapshots, data,
config, plan, monitor, ledger.

Each command imports what it needs inside its function: ``rlray --help`` and ``rlray data`` start in
a second instead of paying for Ray, torch and vLLM (the one place where function-local imports are the rule).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from rlray import __version__
from rlray.config import Config, ConfigError, load_config


def _train(args: argparse.Namespace) -> int:
    from rlray.launch.driver import run_training

    overrides = list(args.overrides) + ([f"checkpoint.resume_from={args.resume}"] if args.resume else [])
    result = run_training(load_config(args.config, overrides), verbose=args.verbose)
    print(json.dumps({"run_id": result.run_id, "status": result.status, "tracking_uri": result.tracking_uri,
                      "final_snapshot": result.final_snapshot, "monitor_url": result.monitor_url, "log_dir": result.log_dir,
                      **({"error": result.error} if result.error else {})}, indent=2))
    if result.error:
        print(f"rlray train: {result.error}", file=sys.stderr)
    return 0 if result.status == "FINISHED" else 1


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

    cfg = resolve_paths(load_config(args.config, args.overrides))
    init_ray()
    start_reward_server(cfg)
    srv = cfg.reward.server
    print(f"rlray-reward version {cfg.reward.version}: POST http://{srv.host}:{srv.port}/score "
          f"(Serve application '{srv.app_name}')", flush=True)
    deploy_judges(cfg)
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
    from rlray.launch.judge_check import judge_check
    from rlray.reward.judges.stats import format_report

    if args.rows < 1:
        print(f"rlray: --rows={args.rows}: give at least 1 row", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)
    result = judge_check(cfg, args.rows, threshold=args.threshold, response_column=args.response_column,
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
    from rlray.checkpoint.lineage import prepare_rollback

    dest = Path(args.dest or f"rollback/{args.ref.rstrip('/').rsplit('/', 1)[-1][:16]}-{args.to}")
    cfg = _optional_config(args)
    print(json.dumps(prepare_rollback(args.ref, args.to, cfg, dest, base=cfg if args.config else None), indent=2))
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

    path = fetch_dataset(args.name, Path(args.dest))
    print(f"{args.name}: {path}")
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

    from rlray.observe.stored import StoredRun

    uri = args.tracking_uri or _optional_config(args).tracking.mlflow_uri
    run_id = args.run.removeprefix("runs:/").strip("/").split("/", 1)[0]
    try:
        stored = StoredRun(uri, run_id, refresh_s=args.refresh_s)
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


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config file for the MLflow store, experiment and S3 options (default: built-in)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted config override, repeatable (e.g. --set tracking.experiment=grpo-gsm8k)")


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser of the ``rlray`` command."""
    p = argparse.ArgumentParser(prog="rlray", description="Ray-native RL post-training for LLMs")
    p.add_argument("--version", action="version", version=f"rlray {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run an experiment: rlray train CONFIG [dotted.key=value ...] [--resume latest|URI]")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. learner.lr=1e-5")
    t.add_argument("--resume", help="'latest' (newest complete snapshot under checkpoint.uri) or a snapshot URI")
    t.add_argument("-v", "--verbose", action="store_true",
                   help="show every process's output and library logs here (default: start lines, one progress bar, "
                   "rlray's warnings and alerts; the full logs go to <run.output_dir>/logs/<run id>/)")
    t.set_defaults(func=_train)

    k = sub.add_parser("check", help="check a config without launching: every input of the run (model, data, rewards, "
                       "environments, storage), then each environment's first prompt with its tools, as the model "
                       "sees it: rlray check CONFIG [dotted.key=value ...]")
    k.add_argument("config")
    k.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. env.default=calc")
    k.set_defaults(func=_check)

    w = sub.add_parser("sweep", help="Ray Tune sweep: rlray sweep CONFIG SWEEP.yaml [dotted.key=value ...]")
    w.add_argument("config")
    w.add_argument("sweep", help="sweep file (space, metric, scheduler), e.g. configs/sweeps/grpo_lr_beta.yaml")
    w.add_argument("overrides", nargs="*", help="dotted overrides of CONFIG, applied before the sweep's values")
    w.set_defaults(func=_sweep)

    e = sub.add_parser("eval", help="score a checkpoint on the eval set: rlray eval CONFIG --checkpoint PATH")
    e.add_argument("config")
    e.add_argument("overrides", nargs="*")
    e.add_argument("--checkpoint", required=True, help="snapshot folder/URI, HF folder or model alias")
    e.set_defaults(func=_eval)

    r = sub.add_parser(
        "serve-reward",
        help="run the reward Serve application and the judges' (reward.judges): rlray serve-reward CONFIG "
        "[dotted.key=value ...] [--detach]; on running apps (same names) it hot-swaps to this config's reward.version",
    )
    r.add_argument("config")
    r.add_argument("overrides", nargs="*")
    r.add_argument("--detach", action="store_true", help="deploy or update, then exit (the app keeps running on the cluster)")
    r.set_defaults(func=_serve_reward)
    j = sub.add_parser("judge", help="judges (reward.judges): rlray judge check CONFIG [dotted.key=value ...] [--rows N]")
    jsub = j.add_subparsers(dest="judge_command", required=True)
    jc = jsub.add_parser("check", help="before training: answer N rows with the policy, judge the answers, and print "
                         "agreement with the reward functions (accuracy, Cohen's kappa, confusion table), the score "
                         "spread, parse failures and position bias")
    jc.add_argument("config")
    jc.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. rollout.samples_per_prompt=8")
    jc.add_argument("--rows", type=int, default=16, help="training rows to answer and judge (default 16)")
    jc.add_argument("--threshold", type=float, help="judge score read as 'yes' from (default: the middle of its scale)")
    jc.add_argument("--response-column", help="judge this column's response of each row instead of the policy's samples")
    jc.add_argument("--label-column", help="a column with a reference value per row (above 0 is 'yes') to agree with")
    jc.add_argument("--json", action="store_true", help="print the reports as JSON")
    jc.set_defaults(func=_judge)

    r = sub.add_parser("rollback", help="prepare a resume from a snapshot: rlray rollback RUN_OR_URI --to STEP|vVERSION")
    r.add_argument("ref", metavar="RUN_OR_URI", help="MLflow run id, a run's snapshot folder, or the storage root")
    r.add_argument("--to", required=True, help="a step (12) or a registered model version (v3)")
    r.add_argument("--dest", help="folder for the resume config (default rollback/<ref>-<to>)")
    _config_args(r)
    r.set_defaults(func=_rollback)

    x = sub.add_parser(
        "export", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="write a run's trained policy as a plain Hugging Face folder (LoRA merged): rlray export RUN_OR_SNAPSHOT "
        "--to DIR [--adapter]",
        description="Writes the policy of a snapshot as a plain Hugging Face folder: safetensors weights, config.json, "
        "generation_config.json,\nthe tokenizer with the run's chat template. transformers loads it "
        "(AutoModelForCausalLM.from_pretrained(DIR))\nand vLLM serves it (python -m vllm.entrypoints.openai.api_server "
        "--model DIR). A LoRA policy is merged into its base\nweights (float32), or kept as a peft adapter folder with "
        "--adapter.",
        epilog="example:\n  rlray export latest --config configs/grpo_gsm8k_tiny.yaml --to exported/grpo\n"
        "  rlray export outputs/run/snapshots/run-1a2b/step_00000040 --to exported/step40\n"
        "  rlray export 1a2b3c4d5e6f --config configs/grpo_gsm8k_tiny.yaml --to exported/grpo --adapter",
    )
    x.add_argument("ref", metavar="RUN_OR_SNAPSHOT", help="a snapshot folder or URI, a run folder (its newest complete "
                   "snapshot), 'latest' (newest under checkpoint.uri) or an MLflow run id (its newest snapshot)")
    x.add_argument("--to", required=True, metavar="DIR", help="a new (or empty) folder for the export")
    x.add_argument("--adapter", action="store_true", help="LoRA runs: write the peft adapter folder instead of merging")
    _config_args(x)
    x.set_defaults(func=_export)

    m = sub.add_parser("models", help="lineage in the Model Registry: rlray models list|show")
    msub = m.add_subparsers(dest="models_command", required=True)
    ml = msub.add_parser("list", help="versions of rlray-<experiment> (of one run with --run)")
    ml.add_argument("--run", help="only the versions of this MLflow run")
    ms = msub.add_parser("show", help="the chain from a version (or a run's newest) back to the first snapshot")
    ms.add_argument("version", help="a version (3 or v3) or an MLflow run id")
    for q in (ml, ms):
        q.add_argument("--experiment", help="experiment name (default: the config's tracking.experiment)")
        _config_args(q)
    m.set_defaults(func=_models)

    s = sub.add_parser("snapshots", help="snapshot storage: rlray snapshots list|lifecycle")
    ssub = s.add_subparsers(dest="snapshots_command", required=True)
    ssub.add_parser("list", help="every snapshot under checkpoint.uri, complete or not")
    lc = ssub.add_parser("lifecycle", help="print (and with --apply, set) S3 lifecycle rules with the retention ages")
    lc.add_argument("--apply", action="store_true", help="set the rules on the bucket")
    for q in ssub.choices.values():
        _config_args(q)
    s.set_defaults(func=_snapshots)

    c = sub.add_parser("config", help="print the resolved config: rlray config CONFIG [dotted.key=value ...] [--describe]; "
                       "rlray config --reference prints the reference of every key, --metrics-reference of every metric (Markdown)")
    c.add_argument("config", nargs="?")
    c.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. learner.lr=1e-5")
    c.add_argument("--describe", action="store_true",
                   help="precede each field with its description (unit and scope) and default, as YAML comments")
    c.add_argument("--reference", action="store_true",
                   help="print the config reference instead: every key of every section with its type, default, unit "
                   "and meaning, as Markdown tables (docs/reference/config.md)")
    c.add_argument("--metrics-reference", action="store_true",
                   help="print the metrics reference instead: every metric key a run logs with its unit, meaning and "
                   "where the live page shows it, as Markdown tables (docs/reference/metrics.md)")
    c.set_defaults(func=_config)

    pl = sub.add_parser(
        "plan",
        help="the memory of every role before any resource is taken, and what to change when it does not fit: "
        "rlray plan CONFIG [dotted.key=value ...] [--gpus N --gpu-memory-gib M --nodes K]; exit 1 when it does not fit",
    )
    pl.add_argument("config")
    pl.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.path=FOLDER (config.json is enough)")
    pl.add_argument("--gpus", type=int, help="GPUs per node to plan for (default: what the config asks; a config that "
                    "asks for none gets a layout: half rollout engines, half learner ranks)")
    pl.add_argument("--gpu-memory-gib", type=float, help="memory of one GPU in GiB (default: this machine's, nvidia-smi)")
    pl.add_argument("--nodes", type=int, default=1, help="nodes of --gpus GPUs each (default 1)")
    pl.set_defaults(func=_plan)

    o = sub.add_parser("monitor", help="serve the live page of a run kept in MLflow (finished or running): "
                       "rlray monitor RUN_ID [--port N] [--host ADDR]")
    o.add_argument("run", metavar="RUN_ID", help="MLflow run id (or runs:/RUN_ID)")
    o.add_argument("--port", type=int, default=0, help="port to serve on (default 0: a free port, printed)")
    o.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the page)")
    o.add_argument("--tracking-uri", help="MLflow store (default: --config's tracking.mlflow_uri, else sqlite:///mlruns/mlflow.db)")
    o.add_argument("--refresh-s", type=float, default=10.0, help="seconds between rereads of a running run (default 10)")
    _config_args(o)
    o.set_defaults(func=_monitor)

    g = sub.add_parser("ledger", help="which prompts a run trained on and how often: rlray ledger RUN_ID [--check] "
                       "[--prompts]")
    g.add_argument("run", metavar="RUN_ID", help="MLflow run id (or runs:/RUN_ID)")
    g.add_argument("--check", action="store_true",
                   help="also check the ledger against the seeded prompt stream of the run's logged config (its data "
                   "files and tokenizer must load here): every prompt of each epoch once, in order; exit 1 when not")
    g.add_argument("--prompts", action="store_true", help="list every prompt: times taken and the steps that took it")
    g.add_argument("--tracking-uri", help="MLflow store (default: --config's tracking.mlflow_uri, else sqlite:///mlruns/mlflow.db)")
    _config_args(g)
    g.set_defaults(func=_ledger)

    d = sub.add_parser("data", help="datasets: rlray data fetch gsm8k|hh-rlhf-harmless|retry-arith|guess-number [--dest data]")
    dsub = d.add_subparsers(dest="data_command", required=True)
    f = dsub.add_parser("fetch")
    f.add_argument("name", choices=["gsm8k", "hh-rlhf-harmless", "retry-arith", "guess-number"])
    f.add_argument("--dest", default="data")
    f.set_defaults(func=_data)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rlray`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command in ("train", "check"):  # a quiet console; train's full log goes to the run's folder (rlray.launch.console)
        from rlray.launch.console import configure_console

        configure_console(args.command == "train" and args.verbose)
    else:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rlray.checkpoint.storage import SnapshotError
    from rlray.data import DataError
    from rlray.launch.placement import PlacementError
    from rlray.launch.preflight import PreflightError
    from rlray.models import ModelError
    from rlray.reward import RewardFunctionError

    try:
        return args.func(args)
    except (ConfigError, SnapshotError, DataError, ModelError, PlacementError, RewardFunctionError, PreflightError) as err:
        print(f"rlray: {err}", file=sys.stderr)  # bad input found before the run: the message says what to fix
        return 2


if __name__ == "__main__":
    sys.exit(main())
