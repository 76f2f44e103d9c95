"""Compares every logged metric of two MLflow runs step by step: does a seeded run repeat itself?

    python benchmarks/compare_runs.py RUN_A RUN_B
    python benchmarks/compare_runs.py RUN_A RUN_B --tracking-uri sqlite:////path/to/mlruns/mlflow.db
    python benchmarks/compare_runs.py RUN_A RUN_B --atol 1e-6 --ignore eval/
    python benchmarks/compare_runs.py RUN_A RUN_B --tracking-uri sqlite:////old/mlruns/mlflow.db \
        --tracking-uri-b sqlite:////new/mlruns/mlflow.db --rename reward/accuracy=reward/gsm8k_correct

Reads each run's full history of every metric key (``MlflowClient.get_metric_history``) and compares
the (step, value) series key by key. Keys under ``timing/``, ``perf/`` and ``monitor/`` are left out
by default: they are wall-clock or memory readings by nature (step seconds, tokens/s, the monitor's
heartbeat age and RSS), not results of the run. A key logged by only one run is a difference;
values must be equal exactly (NaN equals NaN) unless ``--atol`` allows more. Runs of two versions may
live in two stores (``--tracking-uri-b``) and name a metric differently (``--rename A_KEY=B_KEY`` reads
run A's key under run B's name). Prints a markdown table
(key, steps, max |diff|, status; a DIFF names its first differing step) and a summary line; exits 0
when the runs are equal, 1 when not (or when no key was left to compare).

Typical use: run ``rlray train configs/grpo_gsm8k_smollm2.yaml run.max_steps=3 eval.num_problems=0``
twice (each prints its MLflow run id) and compare the two ids.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

DEFAULT_IGNORE = ("timing/", "perf/", "monitor/")
DEFAULT_URI = "sqlite:///mlruns/mlflow.db"

Series = list[tuple[int, float]]


def metric_histories(client, run_id: str, ignore: Sequence[str]) -> dict[str, Series]:
    """Returns {key: [(step, value), ...]} of every metric of ``run_id`` whose key starts with no ``ignore`` prefix.

    Each series is in logging order within a step (sorted by step, then timestamp).
    """
    keys = sorted(k for k in client.get_run(run_id).data.metrics if not k.startswith(tuple(ignore)))
    out = {}
    for key in keys:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        out[key] = [(int(m.step), float(m.value)) for m in history]
    return out


def value_diff(a: float, b: float) -> float:
    """Returns |a - b|; 0.0 when both are NaN (or the same infinity), inf when only one is NaN."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b)


def compare_series(a: Series | None, b: Series | None, atol: float) -> tuple[str, float | None, str]:
    """Returns (steps, max |diff|, status) of one key: status is "equal", "DIFF", "steps differ" or "only in A|B".

    Series are compared only when they log the same steps in the same order; max |diff| is then over
    every step (None otherwise).
    """
    if a is None or b is None:
        present = a if a is not None else b
        return str(len(present or [])), None, "only in A" if b is None else "only in B"
    steps_a, steps_b = [s for s, _ in a], [s for s, _ in b]
    if steps_a != steps_b:
        return f"{len(a)}/{len(b)}", None, "steps differ"
    worst = max((value_diff(x, y) for (_, x), (_, y) in zip(a, b, strict=True)), default=0.0)
    return str(len(a)), worst, "equal" if worst <= atol else "DIFF"


def compare_runs(hist_a: dict[str, Series], hist_b: dict[str, Series], atol: float) -> list[tuple[str, str, float | None, str]]:
    """Returns one row (key, steps, max |diff|, status) per key of either run, sorted by key."""
    return [(key, *compare_series(hist_a.get(key), hist_b.get(key), atol)) for key in sorted(set(hist_a) | set(hist_b))]


def first_difference(a: Series, b: Series, atol: float) -> str:
    """Returns "step S: A vs B" for the first step whose values differ by more than ``atol`` ("" when none)."""
    for (step, x), (_, y) in zip(a, b, strict=False):
        if value_diff(x, y) > atol:
            return f"step {step}: {x!r} vs {y!r}"
    return ""


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Returns a GitHub markdown table of string cells (the layout of benchmarks/benchlib.py)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Compares two runs, prints the table and the summary; returns 0 when they are equal, 1 when not."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Ignored by default: timing/* and perf/* (durations and throughput) and monitor/* (the monitor's "
        "heartbeat seconds and process RSS): wall-clock or memory readings by nature.",
    )
    p.add_argument("run_a", metavar="RUN_A", help="MLflow run id")
    p.add_argument("run_b", metavar="RUN_B", help="MLflow run id")
    p.add_argument("--tracking-uri", default=DEFAULT_URI, help=f"MLflow tracking URI (default: {DEFAULT_URI})")
    p.add_argument("--tracking-uri-b", default=None, help="RUN_B's tracking URI when it is in another store (default: --tracking-uri)")
    p.add_argument("--rename", nargs="*", default=[], metavar="A_KEY=B_KEY",
                   help="compare run A's A_KEY with run B's B_KEY (a metric renamed between versions)")
    p.add_argument("--atol", type=float, default=0.0, help="largest |A - B| that still counts as equal (default: 0, exact)")
    p.add_argument("--ignore", nargs="*", default=list(DEFAULT_IGNORE), metavar="PREFIX",
                   help="key prefixes to leave out; replaces the default (%(default)s); --ignore with no prefix compares every key")
    args = p.parse_args(argv)

    from mlflow.tracking import MlflowClient

    renames = dict(item.split("=", 1) for item in args.rename if "=" in item)
    if len(renames) != len(args.rename):
        p.error("--rename takes A_KEY=B_KEY items")
    hist_a = metric_histories(MlflowClient(tracking_uri=args.tracking_uri), args.run_a, args.ignore)
    hist_a = {renames.get(k, k): v for k, v in hist_a.items()}
    hist_b = metric_histories(MlflowClient(tracking_uri=args.tracking_uri_b or args.tracking_uri), args.run_b, args.ignore)
    rows = compare_runs(hist_a, hist_b, args.atol)
    table = []
    for key, steps, diff, status in rows:
        note = first_difference(hist_a[key], hist_b[key], args.atol) if status == "DIFF" else ""
        table.append([key, steps, "n/a" if diff is None else f"{diff:.3g}", status + (f" ({note})" if note else "")])
    print(f"A = {args.run_a}\nB = {args.run_b}\nignored prefixes: {', '.join(args.ignore) or 'none'}; atol = {args.atol:g}"
          + (f"; renamed (A -> B): {', '.join(f'{a} -> {b}' for a, b in renames.items())}" if renames else "") + "\n")
    print(markdown_table(["key", "steps", r"max \|diff\|", "status"], table))
    bad = [r[0] for r in rows if r[3] != "equal"]
    if not rows:
        print("\nno metric to compare: neither run logged a key outside the ignored prefixes")
        return 1
    print(f"\n{len(rows) - len(bad)} of {len(rows)} keys equal; "
          + (f"{len(bad)} differ: {', '.join(bad)}" if bad else "the runs repeat exactly" if args.atol == 0 else "the runs agree within atol"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
