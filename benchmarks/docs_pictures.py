"""The documentation's pictures, made from runs: the live page in headless chromium, and a learning curve from MLflow.

    python benchmarks/docs_pictures.py monitor                       # the made-up 30-step run of tests/fixtures/page_demo.py
    python benchmarks/docs_pictures.py monitor --url http://127.0.0.1:PORT/   # a live run's page (its start line names it)
    python benchmarks/docs_pictures.py curve --run RUN_ID [--tracking-uri URI] [--results outputs/env_learning/env_learning.json]
    python benchmarks/docs_pictures.py curve --results outputs/env_learning/env_learning.json   # make demo's run

``monitor`` writes docs/images/monitor.png: the whole page once its curves and sample table are drawn
(``page_demo.capture_page``; needs Debian's chromium and chromium-driver, ``make browser``).

``curve`` writes docs/images/learning_curve.png from one MLflow run: per step, the training reward (``reward/mean``)
and, where the run logged it, held-out success (``eval/env_success``, logged at eval steps). ``--results`` adds
``make demo``'s held-out success before training (at step 0) and after it (at the run's last step), from the JSON
benchmarks/env_learning.py writes (its ``run_id`` names the run when ``--run`` is not given). Pure pieces
(``run_series``, ``plot_learning_curve``) have tests in tests/benchmarks/test_docs_pictures.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the checkout's rlray, also when another copy is installed
    sys.path.insert(0, str(REPO))

MONITOR_PNG = REPO / "docs" / "images" / "monitor.png"
CURVE_PNG = REPO / "docs" / "images" / "learning_curve.png"
DEFAULT_URI = "sqlite:///mlruns/mlflow.db"  # tracking.mlflow_uri's default, against the working folder
CURVE_KEYS = ("reward/mean", "eval/env_success")  # plotted where the run logged them


def run_series(uri: str, run_id: str, keys: Sequence[str] = CURVE_KEYS) -> dict[str, list[tuple[int, float]]]:
    """Returns {key: [(step, value), ...] in step order} of the ``keys`` that MLflow run ``run_id`` logged.

    Raises:
        mlflow.exceptions.MlflowException: no such run in the store ``uri``.
    """
    from rlray.observe.tracking import get_run_metrics

    logged = get_run_metrics(uri, run_id)
    return {k: sorted(logged[k]) for k in keys if logged.get(k)}


def plot_learning_curve(series: dict[str, list[tuple[int, float]]], before_after: tuple[float, float] | None,
                        title: str) -> Any:
    """Returns a matplotlib Figure: one line per series (step on x), and with ``before_after`` (held-out success
    rates in [0, 1]) two marked points joined by a dashed line at step 0 and at the last step, each labelled in %.

    Raises:
        ValueError: nothing to plot (no series and no before/after).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    if not series and before_after is None:
        raise ValueError("nothing to plot: the run logged none of the keys, and no --results was given")
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for key, points in series.items():
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o" if len(points) < 30 else None,
                markersize=3, linewidth=1.5, label=key)
    if before_after is not None:
        last = max((points[-1][0] for points in series.values()), default=1)
        xs, ys = [0, last], list(before_after)
        ax.plot(xs, ys, linestyle="--", marker="s", color="black", label="held-out success (before, after)")
        for x, y, where in zip(xs, ys, ("before", "after"), strict=True):
            ax.annotate(f"{where} {100 * y:.1f}%", (x, y), textcoords="offset points", xytext=(6, 6))
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    return fig


def write_curve(args: argparse.Namespace) -> Path:
    """Writes the learning curve of ``--run`` (or the ``--results`` file's run) to ``--out``; returns the path."""
    results = json.loads(Path(args.results).read_text()) if args.results else None
    run_id = args.run or (results or {}).get("run_id")
    if not run_id:
        raise SystemExit("docs_pictures curve: give --run RUN_ID or --results FILE (benchmarks/env_learning.py's JSON)")
    before_after = (results["before"]["success"], results["after"]["success"]) if results else None
    title = args.title or (f"{results['config']}, seed {results['seed']}: run {run_id[:8]}" if results else f"run {run_id[:8]}")
    fig = plot_learning_curve(run_series(args.tracking_uri, run_id), before_after, title)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def write_monitor(args: argparse.Namespace) -> Path:
    """Writes the live page's screenshot (of ``--url``, else the demo run served here) to ``--out``; returns it."""
    sys.path.insert(0, str(REPO / "tests" / "fixtures"))
    import page_demo  # the browser helpers the page's tests use (headless chromium through chromedriver)

    out = Path(args.out)
    return page_demo.capture_page(args.url, out) if args.url else page_demo.write_screenshot(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="picture", required=True)
    m = sub.add_parser("monitor", help="the live page in headless chromium")
    m.add_argument("--url", help="a running monitor's page (default: the made-up run of tests/fixtures/page_demo.py)")
    m.add_argument("--out", default=str(MONITOR_PNG))
    m.set_defaults(func=write_monitor)
    c = sub.add_parser("curve", help="a run's learning curve from MLflow")
    c.add_argument("--run", help="MLflow run id (default: the run_id of --results)")
    c.add_argument("--tracking-uri", default=DEFAULT_URI)
    c.add_argument("--results", help="benchmarks/env_learning.py's JSON: held-out success before and after")
    c.add_argument("--title")
    c.add_argument("--out", default=str(CURVE_PNG))
    c.set_defaults(func=write_curve)
    args = parser.parse_args(argv)
    print(args.func(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
