"""Starting or joining Ray for a run.

``init_ray`` connects to the cluster in ``RAY_ADDRESS`` or starts an embedded local Ray; ``worker_env`` and
``embedded_ray_env`` are the environment variables its workers get, ``EMBEDDED_RAY_SYSTEM_CONFIG`` an embedded Ray's
own settings; ``RayStart`` runs ``init_ray`` in a thread while the caller does its own start (imports, input checks);
``owns_single_node_ray`` says whether this process started a Ray of one node. Ray Train's trainer for the learner
group is ``rlray.launch.trainer``'s, kept apart so that starting Ray does not import Ray Train (issue 39: ~0.6-0.8 s
of CPU before ``ray.init``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import ray


@dataclass(frozen=True)
class RayInfo:
    """What ``init_ray`` learnt of the cluster: the dashboard's address ("" without one, or when Ray was already
    initialized) and this node's Ray log folder (``<session_dir>/logs``; "" when unknown)."""

    dashboard_url: str = ""
    logs_dir: str = ""


def worker_env(hub_offline_default: str = "0") -> dict[str, str]:
    """Returns the environment variables every Ray worker of a run gets (``init_ray``'s runtime_env).

    - ``TOKENIZERS_PARALLELISM=false``: no tokenizer thread pools beside torch's.
    - ``HF_HUB_OFFLINE``: this process's value, else ``hub_offline_default``.
    - ``HF_HUB_DISABLE_PROGRESS_BARS``: this process's value, else "1": transformers' and the hub's tqdm bars
      ("Loading weights", "Writing model shards") stay out of the run's console; rlray prints its own progress.
    """
    return {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", hub_offline_default),
            "HF_HUB_DISABLE_PROGRESS_BARS": os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "1")}


EMBEDDED_RAY_DEFAULTS = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


def embedded_ray_env() -> dict[str, str]:
    """Returns the environment variables added for an embedded local Ray (one node, this machine), each this
    process's value when it has one.

    - ``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0``: Ray Train's PreemptionWatcher actor polls the cluster for nodes
      being drained (spot reclaims, autoscaler scale-down); an embedded Ray is this one node, never drained, so the
      watcher would only cost a worker process and its imports at every learner start (about 2 s of CPU, measured
      with ``benchmarks/startup.py``). A cluster keeps it (``RAY_ADDRESS`` or ``ray job submit``).
    - ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.5``: Ray Train's controller polls its worker group every 2 s by
      default, so a finished run waits 1 s on average (up to 2) before ``fit`` returns. On one node a poll is
      a few local calls; a cluster keeps Ray's 2 s.
    """
    return {name: os.environ.get(name, default) for name, default in EMBEDDED_RAY_DEFAULTS.items()}


EMBEDDED_RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}
"""Ray's own settings of an embedded local Ray (``ray.init(_system_config=...)``; a cluster joined keeps its own).

``prestart_worker_first_driver=False``: by default the raylet starts one idle Python worker per CPU as soon as the
first driver connects, for tasks that may come. A run's work is actors, each started in a worker of its own (with its
resources and runtime environment), so those workers stay idle to the end; on a 2-core machine the two of them cost
about 1.3 s of CPU while the engines and the learner load (issue 39, measured per process until the first step ends:
``ray::IDLE``). A task, when one comes, starts its worker then."""


def init_ray(*, include_dashboard: bool | None = None, log_to_driver: bool = True) -> RayInfo:
    """Connects to the cluster in RAY_ADDRESS, or starts an embedded local Ray (bound to 127.0.0.1); returns its
    dashboard address and log folder.

    ``log_to_driver=False`` keeps every worker's and actor's output in Ray's log files instead of copying it to
    this console, and sets the driver's "ray" logger to WARNING (``rlray train`` without ``-v``). Nothing changes
    when Ray is already initialized (the log folder is still returned where this process started that Ray).
    """
    if ray.is_initialized():  # started by the caller (a benchmark, a test): its log folder, when Ray tells it
        node = getattr(ray._private.worker, "_global_node", None)  # private; absent on a client connection
        return RayInfo("", node.get_logs_dir_path() if node is not None else "")
    quiet = {} if log_to_driver else {"log_to_driver": False, "logging_level": logging.WARNING}
    env = worker_env()
    # Inside `ray job submit` the job's runtime_env already applies, and Ray refuses a ray.init
    # runtime_env that sets one of its env vars again: add only what the job leaves unset.
    if job_json := os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        job_env = (json.loads(job_json).get("runtime_env") or {}).get("env_vars") or {}
        env = {k: v for k, v in env.items() if k not in job_env}
    if os.environ.get("RAY_ADDRESS"):
        ctx = ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env}, **quiet)
    else:
        env.update(embedded_ray_env())
        local = {"include_dashboard": include_dashboard, "dashboard_host": "127.0.0.1", "runtime_env": {"env_vars": env}}
        try:
            ctx = ray.init(**local, _system_config=dict(EMBEDDED_RAY_SYSTEM_CONFIG), **quiet)
        except ValueError as err:  # no RAY_ADDRESS, but a `ray start` cluster of this machine was found: joined as is
            if "_system_config" not in str(err):
                raise
            ctx = ray.init(**local, **quiet)
    session_dir = (getattr(ctx, "address_info", None) or {}).get("session_dir") or ""
    return RayInfo(getattr(ctx, "dashboard_url", None) or "", str(Path(session_dir, "logs")) if session_dir else "")


class _NotMainThreadNote(logging.Filter):
    """Drops Ray's "SIGTERM handler is not set" warning of a ``ray.init`` called off the main thread (``RayStart``
    sets the same handler from the main thread afterwards)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


class RayStart:
    """``init_ray`` in a background thread, started at construction, so that Ray's processes come up while the caller
    goes on: ``rlray train`` imports the driver's modules (transformers, MLflow) and checks the run's inputs meanwhile
    (issue 39: Ray's start is ~5.5 s of wall time on 2 cores, mostly its own processes' work, and the driver's imports
    and checks ~5 s of one core before it; they now overlap).

    Nothing is started when Ray is already initialized (a test's, a benchmark's or a sweep's Ray): ``result`` then
    answers as ``init_ray`` does.

    Args:
        log_to_driver, include_dashboard: as ``init_ray``.
    """

    def __init__(self, *, log_to_driver: bool = True, include_dashboard: bool | None = None) -> None:
        self.info: RayInfo | None = None
        self.error: BaseException | None = None
        self.started_here = not ray.is_initialized()
        self._args = {"log_to_driver": log_to_driver, "include_dashboard": include_dashboard}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlray-ray-start", daemon=True)
        if self.started_here:
            self._thread.start()

    def _run(self) -> None:
        note = _NotMainThreadNote()
        ray_logger = logging.getLogger("ray._private.worker")
        ray_logger.addFilter(note)
        try:
            self.info = init_ray(**self._args)
        except BaseException as err:  # noqa: BLE001 - raised again by result() on the caller's thread
            self.error = err
        finally:
            ray_logger.removeFilter(note)
            self._done.set()
        # Ray starts its processes (GCS, raylet, dashboard) with PR_SET_PDEATHSIG=SIGKILL, which Linux sends when the
        # *thread* that started them ends, not the process: this thread stays (daemon, idle) for the process's life.
        threading.Event().wait()

    def result(self) -> RayInfo:
        """Waits for Ray's start and returns ``init_ray``'s ``RayInfo``. Called from the main thread, it also sets
        the SIGTERM handler ``ray.init`` sets there (exit, so that Ray's exit hooks stop its processes), unless the
        process already has one of its own.

        Raises:
            Exception: whatever ``ray.init`` raised (a port taken, a cluster that cannot be joined).
        """
        if not self.started_here:
            return init_ray(**self._args)
        self._done.wait()
        if self.error is not None:
            raise self.error
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)):
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        assert self.info is not None
        return self.info

    def cancel(self) -> None:
        """Waits for the start to end and shuts down the Ray it started (the run stopped before using it: an input
        check failed); nothing when Ray was already initialized by the caller."""
        if not self.started_here:
            return
        self._done.wait()
        if self.error is None and ray.is_initialized():
            ray.shutdown()


def owns_single_node_ray() -> bool:
    """True when this process started the Ray it is connected to (``ray.init`` without an address: an embedded local
    Ray, or a test session's) and that Ray is one node: no autoscaler can add nodes, and Ray stops with this process.

    False for a cluster joined through ``RAY_ADDRESS`` or ``ray job submit``, and before ``ray.init``.
    """
    node = getattr(ray._private.worker, "_global_node", None)  # private; None before ray.init and on a client
    if node is None or not getattr(node, "head", False):
        return False
    return sum(1 for n in ray.nodes() if n.get("Alive")) == 1
