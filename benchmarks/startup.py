"""Where a run's time goes before its first step and after its last (issue 39): ``rlray train`` for 2 steps in a
fresh process, its wall time, and the ``startup/*`` seconds of its JSON summary (``rlray.observe.startup``) as a table.

    python benchmarks/startup.py                              # configs/grpo_gsm8k_tiny.yaml, 2 steps, one run
    python benchmarks/startup.py --smollm2                    # also configs/grpo_gsm8k_smollm2.yaml (2 steps)
    python benchmarks/startup.py --repeats 2 --variant before=/path/to/old/checkout --variant after=.

Rows (seconds; each actor's figures are its own, and actors start together, so they overlap):

- checks: paths, the run plan, the preflight (model, tokenizer, data, reward functions), the step hooks;
- ray: what is left of ``ray.init`` (an embedded local Ray, started in a thread by ``rlray train`` before the driver's
  imports, so that most of it runs beside them and the checks) and the resources check; mlflow: the MLflow run, its
  params and tags;
- actors: from asking for the monitor and the rollout, environment, reference actors to the page serving (the
  engines and models load on beside the learner's start);
  per actor ``<name>`` (asked for to started), ``<name>_imports`` (to its ``__init__``: the worker process and its
  imports) and ``<name>_load`` (its ``__init__``: the engine or the model; the monitor's page);
- learner_start: Ray Train's ``fit`` to learner rank 0's start (the controller, the worker processes, their
  imports); learner_load: to the first step's start (model, optimizer, data);
- first_rollout, first_step: the first step's ``timing/rollout_s`` and ``timing/step_s``; to_first_step: the
  driver's ``run_training`` call to the first step's end;
- after_last_step: the last step's end to ``fit``'s return (its snapshot, the learner's finish, Ray Train's
  teardown); shutdown: to ``run_training``'s return (actors killed, Ray's logs copied);
- total: ``run_training``; outside: wall minus total (Python's start, the CLI's imports beside Ray's start, Ray's
  exit).

``--variant NAME=PATH`` runs the rlray of another checkout (PATH first on PYTHONPATH; its data and configs are this
checkout's): a checkout before the ``startup/*`` figures gives the wall time only. Variants run interleaved (each
repeat runs every variant once), so a machine whose load changes affects them alike. Results go to
bench_results/startup.json. Never a test: the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import benchlib

CONFIGS = {"tiny": "configs/grpo_gsm8k_tiny.yaml", "smollm2": "configs/grpo_gsm8k_smollm2.yaml"}
PHASES = ("checks", "ray", "mlflow", "actors", "monitor_imports", "monitor_load", "monitor", "rollout-0_imports",
          "rollout-0_load", "rollout-0", "learner_start", "learner_load", "first_rollout", "first_step", "to_first_step",
          "after_last_step", "shutdown", "total")
TIMEOUT_S = 1800


def summary_json(log_text: str) -> dict[str, Any] | None:
    """Returns the JSON summary ``rlray train`` prints last (from its last line that is a lone '{'), or None."""
    lines = log_text.splitlines()
    starts = [i for i, line in enumerate(lines) if line == "{"]
    if not starts:
        return None
    try:
        return json.loads("\n".join(lines[starts[-1]:]))
    except ValueError:
        return None


def phase_rows(runs: list[dict[str, Any]]) -> list[list[Any]]:
    """Returns the table's rows: one per phase (``PHASES`` first, then any other ``startup/*`` key in order), its
    seconds in each run ('n/a' where a run lacks it), then wall and outside (wall minus total)."""
    keys = [k for k in PHASES if any(f"startup/{k}_s" in r.get("startup", {}) for r in runs)]
    extra = sorted({k[len("startup/"):-2] for r in runs for k in r.get("startup", {})} - set(keys))
    rows = [[k, *(r.get("startup", {}).get(f"startup/{k}_s") for r in runs)] for k in (*keys, *extra)]
    rows.append(["wall", *(r.get("wall_s") for r in runs)])
    rows.append(["outside", *((r["wall_s"] - r["startup"]["startup/total_s"]) if "startup/total_s" in r.get("startup", {})
                              else None for r in runs)])
    return rows


def run_once(config: str, checkout: Path, steps: int, out: Path, label: str) -> dict[str, Any]:
    """Runs ``rlray train CONFIG run.max_steps=STEPS`` with the rlray of ``checkout`` in a fresh process; returns
    ``benchlib.run_child``'s fields plus "status" and "startup" (the summary's ``startup/*`` keys, {} without)."""
    data = benchlib.REPO / "data" / "gsm8k"
    argv = [sys.executable, "-m", "rlray.cli", "train", str(benchlib.REPO / config), f"run.max_steps={steps}",
            f"run.output_dir={out / 'outputs'}", f"tracking.mlflow_uri=sqlite:///{out / 'mlruns' / 'mlflow.db'}",
            f"data.train_files=[{data / 'train.jsonl'}]", f"data.eval_files=[{data / 'test.jsonl'}]"]
    env = benchlib.child_env()
    env["PYTHONPATH"] = f"{checkout}:{env['PYTHONPATH']}"
    print(f"  {label}: running (log {out / 'train.log'})", flush=True)
    out.mkdir(parents=True, exist_ok=True)  # the run's folder: `python -m` puts its cwd first on sys.path (and Ray
    run = benchlib.run_child(argv, log_path=out / "train.log", timeout_s=TIMEOUT_S, env=env, cwd=out)  # the workers')
    summary = summary_json(Path(run["log"]).read_text(errors="replace")) or {}
    if run["returncode"] != 0 or not summary:
        print(f"  {label}: FAILED (exit code {run['returncode']}); last lines:\n{benchlib.tail(run['log'])}", flush=True)
    startup = {k: v for k, v in summary.items() if k.startswith("startup/")}
    print(f"  {label}: {run['wall_s']:.1f} s wall, status {summary.get('status')}", flush=True)
    return {**run, "status": summary.get("status"), "startup": startup}


def cpu_name() -> str:
    """Returns lscpu's model name (platform.processor() where lscpu is missing)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the start-up benchmark; prints one table per config and returns (and writes) the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", action="store_true", help="also configs/grpo_gsm8k_smollm2.yaml")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=PATH",
                        help="the rlray of another checkout (repeatable); default: this checkout")
    parser.add_argument("--quick", action="store_true", help="the default sizes (make bench --quick passes it)")
    args = parser.parse_args(argv)
    variants = dict(v.split("=", 1) for v in args.variant) or {"this": str(benchlib.REPO)}
    benchlib.gsm8k_train_file()  # data/gsm8k of this checkout, from the mirror when missing
    configs = ["tiny", *(["smollm2"] if args.smollm2 else [])]
    results: dict[str, Any] = {"machine": {**benchlib.machine(), "cpu": cpu_name()}, "steps": args.steps, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="rlray-startup-") as tmp:
        for name in configs:
            runs = []
            for repeat in range(args.repeats):
                for variant, path in variants.items():
                    label = f"{name} {variant} #{repeat + 1}"
                    out = Path(tmp, name, f"{variant}-{repeat}")
                    runs.append({"variant": variant, "repeat": repeat + 1,
                                 **run_once(CONFIGS[name], Path(path).resolve(), args.steps, out, label)})
            results["configs"][name] = runs
            headers = ["phase (s)", *(f"{r['variant']} #{r['repeat']}" for r in runs)]
            print(f"\n{CONFIGS[name]}, {args.steps} steps, {results['machine']['cpu']} "
                  f"({results['machine']['host_cores']} cores):\n", flush=True)
            print(benchlib.markdown_table(headers, [[row[0], *map(benchlib.fmt, row[1:])] for row in phase_rows(runs)]),
                  flush=True)
    for runs in results["configs"].values():
        for r in runs:
            r.pop("peak_by_process", None)
    benchlib.write_results("startup", results)
    return results


if __name__ == "__main__":
    main()
