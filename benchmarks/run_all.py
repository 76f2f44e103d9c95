"""Runs every benchmark on its default sizes (``make bench``) and prints one summary of the ratios.

    python benchmarks/run_all.py                     # default sizes (the tables of docs/performance.md)
    python benchmarks/run_all.py --quick             # seconds-scale sizes, a smoke run of every script
    python benchmarks/run_all.py --trl-vllm          # also TRL GRPOTrainer with vLLM colocate (long start-up)
    python benchmarks/run_all.py --only rollout weight_sync

Order: grpo_vs_trl (TRL, rlray sync, rlray async), env_vs_trl (multi-turn tool calling: TRL's
environment_factory vs rlray sync), rollout (rlray vs bare vLLM), weight_sync (N = 1, 2
actors vs memcpy), experience (its step time is rlray sync's, read from grpo_vs_trl's results),
learner_packing (the learner's stages 4 and 6, padded as before against packed with shared prefixes), startup (where a
2-step tiny run's time goes before its first step and after its last), partial_rollouts (an async run's step time and
engine idle time on long-tailed response lengths, with and without rollout.partial).
Each script runs in-process one after another (their measured runs are child processes of their
own), prints its table and writes bench_results/<name>.json; a script that fails is reported and the
others still run. At the end: the summary of the ratios against their targets, also written to
bench_results/summary.json, and the exit code is 1 when a script failed (a missed target is not a
failure: the targets are tracked, not asserted). Each ratio is compared with the last recorded summary of the same
sizes (the summary.json this run replaces): one that moved more than 15% either way is flagged MOVED in the table
and named in a line under it.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from typing import Any

import benchlib

BENCHMARKS = ("grpo_vs_trl", "env_vs_trl", "rollout", "weight_sync", "experience", "learner_packing", "startup",
              "partial_rollouts")
# the targets of the learner's logprobs + update time, packed and shared against the padded layout of before:
# (a) the demo's step, (b) env_vs_trl's
LEARNER_TARGETS = {"demo": 0.5, "env": 0.33}


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs benchmark ``name`` with the shared flags; returns its results (the dict its main returns)."""
    import importlib

    module = importlib.import_module(name)
    argv = ["--quick"] if args.quick else []
    if name == "grpo_vs_trl" and args.trl_vllm:
        argv.append("--trl-vllm")
    return module.main(argv)


def summary_rows(results: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """Returns the summary table's rows: measure, value, target, met? (n/a where a result is missing)."""
    rows: list[list[Any]] = []

    def add(measure: str, value: float | None, target: str, met: bool | None) -> None:
        rows.append([measure, value, target, "n/a" if met is None or value is None else ("yes" if met else "no")])

    for model, r in (results.get("grpo_vs_trl") or {}).get("models", {}).items():
        runs = r.get("runs", {})
        sync = runs.get("rlray-sync", {}).get("step_time_vs_trl")
        add(f"{model}: rlray sync step time / TRL", sync, "<= 0.50", sync is not None and sync <= 0.5)
        pss = runs.get("rlray-sync", {}).get("peak_pss_vs_trl")
        add(f"{model}: rlray sync peak PSS / TRL", pss, "<= 1.20", pss is not None and pss <= 1.2)
        asy = runs.get("rlray-async", {}).get("step_time_vs_sync")
        add(f"{model}: rlray async / sync step time", asy, "<= 1.00", asy is not None and asy <= 1.0)
    env = (results.get("env_vs_trl") or {}).get("runs", {}).get("rlray-sync", {}).get("step_time_vs_trl")
    if (results.get("env_vs_trl") or {}).get("runs"):
        add("multi-turn env step time: rlray sync / TRL environment_factory", env, "<= 0.50", env is not None and env <= 0.5)
    for name, r in (results.get("rollout") or {}).get("runs", {}).items():
        if name != "vllm":
            v = r.get("vs_vllm")
            add(f"rollout tokens/s: {name} / bare vLLM", v, ">= 0.95", v is not None and v >= 0.95)
    for name, r in (results.get("weight_sync") or {}).get("runs", {}).items():
        v = r.get("sync_vs_memcpy")
        add(f"weight sync bytes/s / memcpy: {name}", v, ">= 0.50", v is not None and v >= 0.5)
    for r in (results.get("experience") or {}).get("runs", []):
        if r.get("case") == "step":
            v = r.get("move_vs_step")
            add(f"experience move / step time: {r['world']} rank(s)", v, "<= 0.02", v is not None and v <= 0.02)
    for r in (results.get("learner_packing") or {}).get("results", []):
        target = LEARNER_TARGETS.get(r["workload"])
        runs = r.get("runs", {})
        if target is None or "today" not in runs or "packed+shared" not in runs:
            continue
        before, after = (runs[v]["logprobs_s"] + runs[v]["update_s"] for v in ("today", "packed+shared"))
        v = after / before if before else None
        add(f"learner logprobs + update, {r['workload']} ({r['dtype']}): packed+shared / padded before", v,
            f"<= {target:.2f}", v is not None and v <= target)
    partial = (results.get("partial_rollouts") or {}).get("runs", {}).get("partial", {}).get("step_time_vs_whole")
    if (results.get("partial_rollouts") or {}).get("runs"):
        add("async step time on long-tailed lengths: rollout.partial / whole generations", partial, "<= 1.00",
            partial is not None and partial <= 1.0)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmarks, prints the summary; returns the exit code (1 when a benchmark failed)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="seconds-scale sizes (smoke run)")
    parser.add_argument("--trl-vllm", action="store_true", help="also run TRL with vLLM colocate (grpo_vs_trl)")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these benchmarks")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    failed, seconds = [], {}
    for name in args.only or BENCHMARKS:
        print(f"\n===== {name}{' (--quick)' if args.quick else ''} =====", flush=True)
        start = time.perf_counter()
        try:
            results[name] = run_one(name, args)
        except Exception:  # report and go on: one broken benchmark should not hide the others
            traceback.print_exc()
            failed.append(name)
        seconds[name] = time.perf_counter() - start
        print(f"({name}: {seconds[name]:.0f} s)", flush=True)
    raw = summary_rows(results)
    last = benchlib.read_results("summary")
    previous = last_rows(last, quick=args.quick)
    compared = benchlib.moved_rows(raw, previous)
    rows = [[m, benchlib.fmt(v, 3), t, ok, benchlib.fmt(p, 3), c] for m, v, t, ok, p, c in compared]
    print("\n===== summary (ratios measured inside one run; targets tracked, not asserted) =====\n")
    print(benchlib.markdown_table(["measure", "value", "target", "met", "last", "change"], rows))
    print("\n" + moved_line(compared, last if previous is not None else None))
    print("\nseconds per benchmark: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    benchlib.write_results("summary", {"quick": args.quick, "seconds": seconds, "failed": failed,
                                       "rows": [dict(zip(("measure", "value", "target", "met"), r, strict=True)) for r in raw],
                                       "moved": [r[0] for r in compared if str(r[-1]).startswith("MOVED")]})
    return 1 if failed else 0


def last_rows(last: dict[str, Any] | None, *, quick: bool) -> list[list[Any]] | None:
    """Returns the rows (measure, value) of the last recorded summary (bench_results/summary.json), or None when there
    is none or it was measured at the other size (``--quick`` figures are not comparable with the default sizes)."""
    if not last or bool(last.get("quick")) != quick:
        return None
    return [[r["measure"], r["value"]] for r in last.get("rows", [])]


def moved_line(compared: list[list[Any]], last: dict[str, Any] | None) -> str:
    """Returns the line under the summary that names the ratios moved more than 15% since the last recorded run
    (``benchlib.moved_rows``' rows), or says that none did or that there was nothing to compare with."""
    if last is None:
        return "no earlier summary of these sizes in bench_results/summary.json: nothing to compare with"
    when = (last.get("machine") or {}).get("git_commit") or "an unknown commit"
    moved = [f"{r[0]} ({r[-1].removeprefix('MOVED ')})" for r in compared if str(r[-1]).startswith("MOVED")]
    if not moved:
        return f"no ratio moved more than {benchlib.MOVED:.0%} since the last recorded run (commit {when})"
    return (f"MOVED more than {benchlib.MOVED:.0%} since the last recorded run (commit {when}), check before "
            f"trusting either: {'; '.join(moved)}")


if __name__ == "__main__":
    sys.exit(main())
