"""The ``rlray`` command line: train, sweep, eval, data."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from rlray.config import ConfigError, load_config


def _train(args: argparse.Namespace) -> int:
    from rlray.driver import run_training

    cfg = load_config(args.config, args.overrides)
    result = run_training(cfg)
    print(json.dumps({"run_id": result.run_id, "status": result.status, "tracking_uri": result.tracking_uri,
                      "final_snapshot": result.final_snapshot}, indent=2))
    return 0 if result.status == "FINISHED" else 1


def _sweep(args: argparse.Namespace) -> int:
    from rlray.sweep import load_sweep
    from rlray.tune import run_sweep

    cfg = load_config(args.config, args.overrides)
    result = run_sweep(cfg, load_sweep(args.sweep))
    print(json.dumps({"parent_run_id": result.parent_run_id, "status": result.status, "best_run_id": result.best_run_id,
                      "tracking_uri": result.tracking_uri, "trials": [t.__dict__ for t in result.trials]}, indent=2))
    return 0 if result.status == "FINISHED" else 1


def _eval(args: argparse.Namespace) -> int:
    from rlray.driver import evaluate_checkpoint

    cfg = load_config(args.config, args.overrides)
    print(json.dumps(evaluate_checkpoint(cfg, args.checkpoint), indent=2))
    return 0


def _data(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlray.data import fetch_dataset

    path = fetch_dataset(args.name, Path(args.dest))
    print(f"{args.name}: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser of the ``rlray`` command."""
    p = argparse.ArgumentParser(prog="rlray", description="Ray-native RL post-training for LLMs")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run an experiment: rlray train CONFIG [dotted.key=value ...]")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. learner.lr=1e-5")
    t.set_defaults(func=_train)

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

    d = sub.add_parser("data", help="datasets: rlray data fetch gsm8k|hh-rlhf-harmless [--dest data]")
    dsub = d.add_subparsers(dest="data_command", required=True)
    f = dsub.add_parser("fetch")
    f.add_argument("name", choices=["gsm8k", "hh-rlhf-harmless"])
    f.add_argument("--dest", default="data")
    f.set_defaults(func=_data)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rlray`` console script; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"rlray: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
