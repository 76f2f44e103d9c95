"""The ``rlray`` command line: train, eval, serve-reward, data."""

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


def _eval(args: argparse.Namespace) -> int:
    from rlray.driver import evaluate_checkpoint

    cfg = load_config(args.config, args.overrides)
    print(json.dumps(evaluate_checkpoint(cfg, args.checkpoint), indent=2))
    return 0


def _serve_reward(args: argparse.Namespace) -> int:
    import time

    from rlray.driver import init_ray, resolve_paths, start_reward_server

    cfg = resolve_paths(load_config(args.config, args.overrides))
    init_ray()
    start_reward_server(cfg)
    srv = cfg.reward.server
    print(f"rlray-reward version {cfg.reward.version}: POST http://{srv.host}:{srv.port}/score "
          f"(Serve application '{srv.app_name}')", flush=True)
    if args.detach:
        return 0
    from ray import serve

    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.delete(srv.app_name)
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

    e = sub.add_parser("eval", help="score a checkpoint on the eval set: rlray eval CONFIG --checkpoint PATH")
    e.add_argument("config")
    e.add_argument("overrides", nargs="*")
    e.add_argument("--checkpoint", required=True, help="snapshot folder/URI, HF folder or model alias")
    e.set_defaults(func=_eval)

    r = sub.add_parser(
        "serve-reward",
        help="run the reward Serve application: rlray serve-reward CONFIG [dotted.key=value ...] [--detach]; "
        "on a running app (same reward.server.app_name) it hot-swaps to this config's reward.version",
    )
    r.add_argument("config")
    r.add_argument("overrides", nargs="*")
    r.add_argument("--detach", action="store_true", help="deploy or update, then exit (the app keeps running on the cluster)")
    r.set_defaults(func=_serve_reward)

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
