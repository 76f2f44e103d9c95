"""The work a seeded tiny run does, counted, and held to a committed baseline (issue 42: no silent slowdown).

    python benchmarks/work_counts.py RUN_ID --tracking-uri sqlite:////tmp/x/mlflow.db            # compare
    python benchmarks/work_counts.py RUN_ID --tracking-uri sqlite:////tmp/x/mlflow.db --update   # rewrite the baseline

A run's work counts are deterministic for a seeded synchronous run: tokens the learner computed, padded and saved by
shared prefixes, tokens generated, bytes the weight syncs sent, engine calls, environment steps, gateway calls,
judge calls (``COUNTERS``: each one a step metric summed over the run's steps). Timings are not counts (they vary
from run to run), so none is here. ``make test`` takes the counts of the mixed-environment run
(tests/run/test_envs_e2e.py, which it runs anyway) and compares them with ``tests/fixtures/work_baseline.json``
(``compare``): a counter that grew by more than 1% fails the test, naming it with its old and new values; a counter
the baseline lacks or the run no longer logs fails too. A counter that shrank passes with a note (update the baseline
to keep the gain). The baseline changes on purpose only, in the commit whose change earns it::

    RLRAY_UPDATE_WORK_BASELINE=1 pytest "tests/run/test_envs_e2e.py::test_mixed_environments_two_steps_through_ray"

rewrites the run's entry (``write_baseline``); so does this script with ``--update`` for an MLflow run of the same
settings. Pure helpers (``work_counts``, ``compare``, ``read_baseline``, ``write_baseline``) have tests in
tests/benchmarks/test_work_counts.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "tests" / "fixtures" / "work_baseline.json"
TOLERANCE = 0.01  # growth allowed before a counter fails: 1%
UPDATE_ENV = "RLRAY_UPDATE_WORK_BASELINE"
E2E_TEST = "tests/run/test_envs_e2e.py::test_mixed_environments_two_steps_through_ray"
UPDATE_HINT = (f'{UPDATE_ENV}=1 pytest "{E2E_TEST}" rewrites it; commit {BASELINE.relative_to(REPO)} with the change '
               "that earns the new counts")

# The step metrics that count work (rlray.observe.metrics), each summed over the run's steps. A key the run does not
# log (no judge, no agent) is left out of its counts.
COUNTERS: tuple[str, ...] = (
    "perf/learner_tokens_real",     # tokens the learner's forwards computed (stages 4 and 6, every rank)
    "perf/learner_tokens_padding",  # padding positions computed (0 when packed)
    "perf/learner_tokens_shared",   # tokens not computed thanks to shared prefixes
    "rollout/generated_tokens",     # response tokens the engines generated
    "rollout/engine_calls",         # generate calls to the rollout actors
    "rollout/weight_sync_bytes",    # bytes the weight syncs sent (one sync per step)
    "env/episodes",                 # environment and agent episodes
    "env/steps",                    # environment step calls
    "env/gateway_calls",            # agent calls the gateway answered
    "env/tool_errors",              # failed tool calls (each one a wasted turn)
    "reward/judge_calls",           # requests to judge replicas
    "reward/judge_prompt_tokens",   # tokens the judges read
    "reward/judge_output_tokens",   # tokens the judges wrote
)

Series = list[tuple[int, float]]


def work_counts(metrics: dict[str, Series]) -> dict[str, float]:
    """Returns {counter: its values summed over the run's steps} for each of ``COUNTERS`` the run logged.

    Args:
        metrics: {key: [(step, value), ...]} of a run (``rlray.observe.tracking.get_run_metrics``).

    Raises:
        ValueError: a counter holds a non-finite value (names the key and step).
    """
    out = {}
    for key in COUNTERS:
        if key not in metrics:
            continue
        for step, value in metrics[key]:
            if not math.isfinite(value):
                raise ValueError(f"work counter {key!r} is {value} at step {step}: a count must be finite")
        out[key] = float(sum(v for _, v in metrics[key]))
    return out


@dataclass
class Comparison:
    """What ``compare`` found: failures (the test fails on any) and notes (shrunk counters; they pass).

    Attributes:
        failures: one line per counter that grew past the tolerance, is new, or is gone.
        notes: one line per counter that shrank past the tolerance.
    """

    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Returns True when no counter failed."""
        return not self.failures

    def report(self, name: str) -> str:
        """Returns the message of a failed comparison of run ``name``: each failure, then how to update on purpose."""
        lines = [f"rlray: the work counts of run '{name}' differ from {BASELINE.relative_to(REPO)}:",
                 *(f"  {f}" for f in self.failures), *(f"  (note) {n}" for n in self.notes),
                 f"If the change is meant (the work it adds is worth it), update the baseline: {UPDATE_HINT}."]
        return "\n".join(lines)


def _num(value: float) -> str:
    """Returns a count as written in a message: whole numbers exactly ("103027712"), others with 6 digits."""
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _change(old: float, new: float) -> str:
    """Returns the relative change of ``old`` -> ``new`` as "+1.10%" ("+inf%" from 0)."""
    if old == 0:
        return "+inf%" if new > 0 else "-inf%"
    return f"{100 * (new - old) / old:+.2f}%"


def compare(baseline: dict[str, float], counts: dict[str, float], tolerance: float = TOLERANCE) -> Comparison:
    """Returns how ``counts`` compare with ``baseline``, counter by counter.

    A counter fails when it grew by more than ``tolerance`` (new > old * (1 + tolerance); any growth from 0), when the
    run logged it and the baseline lacks it (a new counter), or when the baseline holds it and the run did not log it
    (a counter renamed or no longer logged). One that shrank by more than ``tolerance`` is a note.

    Args:
        baseline: {counter: value} of the committed baseline.
        counts: {counter: value} of this run (``work_counts``).
        tolerance: the relative growth allowed (0.01: 1%).
    """
    got = Comparison()
    for key in sorted(set(baseline) | set(counts)):
        if key not in baseline:
            got.failures.append(f"{key}: new counter (this run: {_num(counts[key])}), not in the baseline")
            continue
        if key not in counts:
            got.failures.append(f"{key}: in the baseline ({_num(baseline[key])}) but this run did not log it "
                                "(renamed, or no longer logged?)")
            continue
        old, new = baseline[key], counts[key]
        if new > old * (1 + tolerance) or (old == 0 and new > 0):
            got.failures.append(f"{key}: grew {_num(old)} -> {_num(new)} ({_change(old, new)}, more than "
                                f"{100 * tolerance:g}% allowed)")
        elif new < old * (1 - tolerance):
            got.notes.append(f"{key}: shrank {_num(old)} -> {_num(new)} ({_change(old, new)}); update the baseline to keep "
                             "the gain")
    return got


def read_baseline(name: str, path: Path = BASELINE) -> dict[str, float]:
    """Returns the counts of run ``name`` in the baseline file ({} when the file or the run is not there).

    Raises:
        ValueError: the file is not a baseline (names the file and what is wrong).
    """
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    runs = doc.get("runs") if isinstance(doc, dict) else None
    if not isinstance(runs, dict):
        raise ValueError(f"rlray: {path} has no 'runs' object; it is not a work-count baseline ({UPDATE_HINT})")
    return {k: float(v) for k, v in runs.get(name, {}).get("counts", {}).items()}


def write_baseline(name: str, counts: dict[str, float], source: str, path: Path = BASELINE) -> None:
    """Writes ``counts`` as run ``name``'s entry of the baseline file (the other runs' entries kept).

    Args:
        name: the run's name in the file.
        counts: {counter: value} (``work_counts``).
        source: what made the run (the test or command), kept beside its counts.
    """
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc["about"] = ("Work counts of seeded tiny runs (benchmarks/work_counts.py): each counter is a step metric summed "
                    f"over the run's steps. A growth beyond {100 * TOLERANCE:g}% fails the test. {UPDATE_HINT}.")
    doc.setdefault("runs", {})[name] = {"source": source, "counts": {k: counts[k] for k in sorted(counts)}}
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def check_run(name: str, metrics: dict[str, Series], source: str, path: Path = BASELINE) -> Comparison:
    """Returns the comparison of a run's counts with its baseline entry; with ``RLRAY_UPDATE_WORK_BASELINE=1`` in the
    environment, writes them as the new entry first (the comparison then passes)."""
    counts = work_counts(metrics)
    if os.environ.get(UPDATE_ENV) == "1":
        write_baseline(name, counts, source, path)
    return compare(read_baseline(name, path), counts)


def main(argv: list[str] | None = None) -> int:
    """Compares (or with --update records) the work counts of an MLflow run; returns 0 when they pass."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_id")
    parser.add_argument("--tracking-uri", default="sqlite:///mlruns/mlflow.db")
    parser.add_argument("--name", default="mixed_tiny", help="the run's entry in the baseline file")
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--update", action="store_true", help="write the run's counts as the baseline entry")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from rlray.observe.tracking import get_run_metrics

    counts = work_counts(get_run_metrics(args.tracking_uri, args.run_id))
    if args.update:
        write_baseline(args.name, counts, f"benchmarks/work_counts.py {args.run_id} --update", args.baseline)
    got = compare(read_baseline(args.name, args.baseline), counts)
    for key, value in counts.items():
        print(f"{key}: {_num(value)}")
    print("the work counts match the baseline" if got.ok else got.report(args.name))
    return 0 if got.ok else 1


if __name__ == "__main__":
    sys.exit(main())
