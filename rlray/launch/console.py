"""What ``rlray train`` shows on its console, and where the rest goes.

A quiet console by default (``-v``/``--verbose`` shows everything):

- start lines (``start_lines``): the MLflow run and how to open it, the live page with /health and /metrics, the
  Ray dashboard, and the snapshot and log folders;
- one progress bar drawn by the driver (``DriverProgress``) from what the learner reports to the monitor (step,
  the figures of the metric registry's ``PROGRESS_FIELDS``: reward, KL, loss, tokens/s, step time; and an ETA from
  the driver's clock); it moves once per step and ends at 100% when the run finishes. Where the console is not a
  terminal (``ray job logs``) it prints one plain line per step, every step in order even when one poll finds
  several new ones ('rlray step 3/30 (10%) reward=0.412 kl=0.0031 ...');
- the monitor's alerts (guard trips, restarts, stalls, failed snapshots) printed as they come: rlray's warnings
  forwarded on purpose, while other processes' output stays in their log files (Ray's log forwarding off);
- last lines (``end_lines``): how the run ended and the folder that holds every log.

Logging (``configure_console``, ``keep_logs``): the console shows rlray's own warnings and errors (everything at
INFO with verbose); Python warnings are captured into logging; every record at INFO and above goes to
``<run.output_dir>/logs/<run id>/driver.log``, and Ray's log files of the run (every worker, actor and the raylet)
are copied beside it when the run ends (``copy_ray_logs``).
"""

from __future__ import annotations

import logging
import logging.handlers
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from rlray.observe.metrics import PROGRESS_FIELDS
from rlray.observe.monitor import Progress, StepProgress

log = logging.getLogger(__name__)

CONSOLE_HANDLER = "rlray-console"
PENDING_HANDLER = "rlray-pending"  # buffers the driver's log records until the run's log folder is known
DRIVER_LOG = "driver.log"
RAY_LOGS = "ray"  # subfolder of the run's log folder with Ray's log files
# Libraries whose loggers print through handlers of their own and do not propagate (once configured): the quiet
# console routes them through the root logger instead, so they reach driver.log and the console shows them only
# with --verbose. MLflow sets up "mlflow", "alembic", "sqlalchemy.engine" and "huey" when it is imported (after
# configure_console: the driver module imports it), hence route_library_logs again when a run starts.
SELF_PRINTING_LOGGERS = ("mlflow", "alembic", "sqlalchemy.engine", "huey", "ray", "vllm", "transformers", "datasets")


# --------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------
class ConsoleFilter(logging.Filter):
    """Passes what the console shows: every record at INFO and above when ``verbose``, else rlray's own warnings
    and errors only (loggers ``rlray`` and ``rlray.*``, WARNING and above)."""

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbose:
            return record.levelno >= logging.INFO
        ours = record.name == "rlray" or record.name.startswith("rlray.")
        return ours and record.levelno >= logging.WARNING


def configure_console(verbose: bool, stream: TextIO | None = None) -> None:
    """Sets up the driver's logging for ``rlray train``: the console (``stream``, default stderr) through
    ``ConsoleFilter(verbose)``, Python warnings captured into logging (so library FutureWarnings reach the log
    file, not the console), and every record at INFO and above held in memory until ``keep_logs`` names the file.

    Replaces the handlers an earlier call added (others, such as pytest's, stay); the root level becomes INFO. The
    loggers of ``SELF_PRINTING_LOGGERS`` lose their own console handlers and propagate to the root. Without
    ``verbose``, transformers' and the Hugging Face hub's progress bars are off in this process (the Ray workers get
    ``HF_HUB_DISABLE_PROGRESS_BARS=1``, ``rlray.launch.ray_setup.worker_env``).
    """
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() in (CONSOLE_HANDLER, PENDING_HANDLER)]:
        root.removeHandler(handler)
        handler.close()
    console = logging.StreamHandler(stream or sys.stderr)
    console.set_name(CONSOLE_HANDLER)
    console.addFilter(ConsoleFilter(verbose))
    console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s" if verbose
                                           else "rlray: %(levelname)s %(name)s: %(message)s"))
    pending = logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1)
    pending.set_name(PENDING_HANDLER)
    root.addHandler(console)
    root.addHandler(pending)
    root.setLevel(logging.INFO)
    logging.captureWarnings(False)  # forget an earlier capture whose showwarning someone has since replaced
    logging.captureWarnings(True)
    if not verbose:  # transformers' and the hub's tqdm bars (a model built or loaded here): rlray draws its own
        from transformers.utils import logging as hf_logging  # sets transformers' logger up: routed just below

        hf_logging.disable_progress_bar()
    route_library_logs()


def route_library_logs() -> None:
    """Routes the loggers of ``SELF_PRINTING_LOGGERS`` through the root logger: each loses its own console handlers
    (stream handlers other than files) and propagates, so its records reach ``driver.log`` and the console only
    through ``ConsoleFilter``. A library imported after ``configure_console`` may have set its logger up again (MLflow
    does at import): ``run_training`` calls this once more when it starts, before Ray starts and before the first
    MLflow call."""
    for name in SELF_PRINTING_LOGGERS:
        library = logging.getLogger(name)
        for handler in [h for h in library.handlers if isinstance(h, logging.StreamHandler)
                        and not isinstance(h, logging.FileHandler)]:
            library.removeHandler(handler)
        library.propagate = True


def keep_logs(folder: Path) -> logging.Handler:
    """Returns the handler that writes every driver log record at INFO and above to ``folder/driver.log`` (created),
    attached to the root logger; records held since ``configure_console`` are written first, and that buffer is
    removed. Detach it with ``release_logs`` when the run ends.

    Raises:
        OSError: the folder cannot be created.
    """
    folder.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(folder / DRIVER_LOG, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for pending in [h for h in root.handlers if h.get_name() == PENDING_HANDLER]:
        assert isinstance(pending, logging.handlers.MemoryHandler)
        pending.setTarget(handler)
        pending.flush()
        root.removeHandler(pending)
        pending.close()
    root.addHandler(handler)
    return handler


def release_logs(handler: logging.Handler) -> None:
    """Detaches and closes a handler from ``keep_logs``."""
    logging.getLogger().removeHandler(handler)
    handler.close()


def copy_ray_logs(src: Path, dest: Path, since: float) -> list[Path]:
    """Returns the files copied from Ray's log folder ``src`` into ``dest`` (relative paths kept): the regular files
    modified at or after ``since`` (epoch seconds, the run's start), so a long-lived cluster's older sessions and
    jobs stay out. An unreadable file is skipped with a log line; a missing ``src`` copies nothing.

    Args:
        src: Ray's ``<session_dir>/logs`` on this node (``RayInfo.logs_dir``).
        dest: the run's ``logs/<run id>/ray`` folder.
        since: epoch seconds; older files are left out.
    """
    copied: list[Path] = []
    if not src.is_dir():
        return copied
    for path in sorted(src.rglob("*")):
        try:
            if not path.is_file() or path.is_symlink() or path.stat().st_mtime < since:
                continue
            target = dest / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            copied.append(target)
        except OSError as err:  # a file Ray rotates or removes while we copy
            log.info("not copied: %s (%s)", path, err)
    return copied


# --------------------------------------------------------------------------------------------
# Lines
# --------------------------------------------------------------------------------------------
def start_lines(*, run_id: str, tracking_uri: str, monitor_url: str, dashboard_url: str, snapshot_dir: str,
                log_dir: str, verbose: bool) -> list[str]:
    """Returns the start lines of ``rlray train``: the MLflow run and how to open it, the live page (with /health
    and /metrics), the Ray dashboard (left out when Ray runs without one), and the snapshot and log folders."""
    dashboard = dashboard_url if "://" in dashboard_url or not dashboard_url else f"http://{dashboard_url}"
    lines = [
        f"rlray: MLflow run {run_id} in {tracking_uri} "
        f"(open: mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1 --port 5000; or rlray monitor {run_id})",
        f"rlray: live page at {monitor_url}/ (curves and samples), health at {monitor_url}/health, "
        f"metrics at {monitor_url}/metrics",
    ]
    if dashboard:
        lines.append(f"rlray: Ray dashboard at {dashboard}")
    lines.append(f"rlray: snapshots under {snapshot_dir}")
    lines.append(f"rlray: logs in {log_dir} ({DRIVER_LOG}; every Ray process's log in {RAY_LOGS}/ when the run ends)"
                 + ("" if verbose else "; -v shows them here"))
    return lines


def end_lines(*, status: str, step: int, total_steps: int, final_snapshot: str, log_dir: str, ray_files: int,
              ray_logs_dir: str) -> list[str]:
    """Returns the last lines of ``rlray train``: the status and step, the last snapshot, and where the logs are
    (``ray_files`` of Ray's files copied; 0 names Ray's own folder, on the head node, instead)."""
    lines = [f"rlray: {status} at step {step}/{total_steps}" + (f"; last snapshot {final_snapshot}" if final_snapshot else "")]
    where = f"{RAY_LOGS}/ ({ray_files} files)" if ray_files else f"Ray's folder {ray_logs_dir or '(unknown)'} on the head node"
    lines.append(f"rlray: full logs in {log_dir}: {DRIVER_LOG}, every Ray process's in {where}")
    return lines


def duration_text(seconds: float) -> str:
    """Returns ``seconds`` as '42s', '5m07s' or '2h05m'."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_fields(metrics: dict[str, float], eta_s: float | None) -> str:
    """Returns the bar's figures, e.g. 'reward=0.412 kl=0.0031 tokens/s=912 step=12.3s eta=5m33s': each of
    ``metrics.PROGRESS_FIELDS`` the step logged, and the ETA in seconds (left out when None)."""
    parts = [f"{f.label}={f.fmt.format(metrics[f.key])}" for f in PROGRESS_FIELDS if f.key in metrics]
    if eta_s is not None:
        parts.append(f"eta={duration_text(eta_s)}")
    return " ".join(parts)


# --------------------------------------------------------------------------------------------
# The bar
# --------------------------------------------------------------------------------------------
class DriverProgress:
    """One progress bar of a run, drawn in the driver process from the monitor's progress record
    (``rlray.observe.monitor.Progress``: status, alerts, the recorded steps with their figures).

    ``show`` applies one record: each recorded step not shown yet, in the order the monitor recorded them, moves the
    bar to that step (never backwards except after a rollback) with ``progress_fields`` as its figures, or prints its
    plain line; each new alert is printed once. A poll that comes after two steps therefore still shows both. Before
    the first recorded step the bar stands at the heartbeat's step (a resumed run's snapshot step). The ETA is the
    steps left times the driver's mean wall time per step seen so far (the first step, which includes start-up, is
    not counted), or the time left until ``ends_by`` (``run.max_wall_time_s``) when that comes first. ``start`` polls
    every ``interval_s`` on a daemon thread; ``close`` polls once more, so a finished run's bar ends at its last step
    (100%).

    Args:
        total_steps: ``run.max_steps``.
        poll: returns the monitor's progress record (a Ray call in the driver).
        stream: where the bar goes (default stderr).
        interval_s: seconds between polls.
        tty: draw a bar (True) or one plain line per step (False); default ``stream.isatty()``.
        ends_by: ``time.monotonic()`` when ``run.max_wall_time_s`` stops the run (None: no budget).
    """

    def __init__(self, total_steps: int, poll: Callable[[], Progress], *, stream: TextIO | None = None,
                 interval_s: float = 1.0, tty: bool | None = None, ends_by: float | None = None) -> None:
        self.total_steps, self.poll, self.interval_s, self.ends_by = total_steps, poll, interval_s, ends_by
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.step: int | None = None
        self.seq = 0  # the last recorded step shown (``StepProgress.seq``)
        self.seen_alerts: set[tuple[str, int | None, float | None]] = set()
        self._first: tuple[int, float] | None = None  # (step, monotonic time) of the first step seen
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bar = tqdm(total=total_steps, desc="rlray train", unit="step", file=self.stream, mininterval=0,
                        dynamic_ncols=True, bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                        "[{elapsed}] {postfix}") if self.tty else None

    def eta_s(self, step: int, now: float) -> float | None:
        """Returns the seconds left at ``step`` by the mean time per step since the first step seen, at most the time
        left until ``ends_by`` (the run's wall-time budget), or None before two steps were seen."""
        if self._first is None or step <= self._first[0]:
            return None
        per_step = (now - self._first[1]) / (step - self._first[0])
        left = per_step * max(0, self.total_steps - step)
        return left if self.ends_by is None else min(left, max(0.0, self.ends_by - now))

    def show(self, progress: Progress) -> list[str]:
        """Applies one progress record; returns the plain lines printed (alerts, and each new step's line without a
        tty), in order."""
        printed: list[str] = []
        with self._lock:
            for alert in progress.alerts:
                key = (alert.kind, alert.step, alert.time)
                if key not in self.seen_alerts:
                    self.seen_alerts.add(key)
                    printed.append(f"rlray: alert {alert.kind} at step {alert.step}: {alert.message}")
            new = [r for r in progress.steps if r.seq > self.seq]
            for record in new:
                line = self._move(record)
                if line is not None:
                    printed.append(line)
            if not new and self.seq == 0 and self.bar is not None and 0 < progress.step != self.bar.n:
                self.bar.n = progress.step  # a resumed run before its first step: the snapshot's step
                self.bar.refresh()
            for line in printed:
                if self.bar is not None:
                    self.bar.write(line, file=self.stream)  # above the bar, which is drawn again below
                else:
                    print(line, file=self.stream, flush=True)
        return printed

    def _move(self, record: StepProgress) -> str | None:
        """Moves to a recorded step; returns its plain line (None with a bar, which is redrawn instead)."""
        now = time.monotonic()
        if self._first is None or record.step < self._first[0]:
            self._first = (record.step, now)
        fields = progress_fields(record.metrics, self.eta_s(record.step, now))
        self.step, self.seq = record.step, record.seq
        if self.bar is None:
            return f"rlray step {record.step}/{self.total_steps} ({100 * record.step // self.total_steps}%) {fields}"
        self.bar.set_postfix_str(fields, refresh=False)
        self.bar.n = record.step  # absolute: a resume starts at its snapshot's step, a rollback goes back
        self.bar.refresh()
        return None

    def start(self) -> DriverProgress:
        """Starts polling on a daemon thread; returns self."""
        self._thread = threading.Thread(target=self._run, name="rlray-progress", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stops polling, applies one last document (when the poll still answers) and closes the bar; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            self.show(self.poll())
        except Exception as err:  # the monitor is gone (the run failed): the bar keeps its last step
            log.info("progress: last poll failed: %s", err)
        if self.bar is not None:
            self.bar.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.show(self.poll())
            except Exception as err:  # a slow or restarting monitor: try again at the next interval
                log.info("progress: poll failed: %s", err)
