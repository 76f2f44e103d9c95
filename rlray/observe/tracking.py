"""MLflow tracking and the Model Registry: with ``rlray.observe.tracking_store``, the only module of rlray that
imports mlflow.

One run per training job. Params are the flattened config at start; metrics are namespaced
(``rollout/``, ``reward/``, ``learner/``, ``algo/``, ``timing/``, ``perf/``, ``eval/``); the resolved
config is an artifact. The keys a run logs, with their units and meanings, are registered in
``rlray.observe.metrics`` (which imports no mlflow); this module writes whatever it is given. Each online step's kept
rollouts are a table artifact (``log_samples``: ``samples/step_<step>.json``), and its prompt ledger a JSON
artifact (``log_ledger``: ``ledger/step_<step>.json``, read back by ``read_ledger``). With ``tensorboard_dir`` every
metric also goes to TensorBoard event files in ``<tensorboard_dir>/<run id>``, written as it is logged (an
MLflow outage does not hold them back).

The store going away mid-run never stops training: ``Tracker`` keeps the metrics, tags and text artifacts
it could not write (with their original steps and timestamps), warns once per outage, and writes them all,
in order, at the next write that gets through (a warning says so). ``close`` retries for a while at the
end of the run; what still cannot be written is saved to a JSON Lines file and named in an error, never
dropped. Errors that retrying cannot fix (``INVALID_PARAMETER_VALUE``, a deleted run) are raised.

A sqlite store is created once per file, under a file lock, before any other use (``ensure_store``, in
``rlray.observe.tracking_store``: from a migrated template, so a fresh folder skips MLflow's migrations): rlray
commands started together on a fresh working folder would otherwise all run MLflow's migrations at once, and all
but one die in them.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from rlray.observe.metrics import KeySanitizer
from rlray.observe.samples import StepSample, table_columns
from rlray.observe.tracking_store import (  # noqa: F401 - re-exported
    STORE_LOCK_TIMEOUT_S,
    ensure_store,
    resolve_tracking_uri,
)

log = logging.getLogger(__name__)


class LoggedConfig(Protocol):
    """What ``Tracker.log_config`` reads of a run's config (``rlray.config.Config``; a plan's ``RunPlan.settings``):
    ``flat()`` {dotted key: value} (MLflow's params), ``to_yaml()`` (``config/resolved.yaml``) and ``config_hash()``.
    No config schema is imported here: the monitor actor's process builds a Tracker for its alerts without torch."""

    def flat(self) -> dict[str, Any]: ...
    def to_yaml(self) -> str: ...
    def config_hash(self) -> str: ...


def _client(uri: str) -> MlflowClient:
    """Returns an ``MlflowClient`` for ``uri`` after ``ensure_store``."""
    ensure_store(uri)
    return MlflowClient(tracking_uri=uri)


# MLflow error codes that retrying cannot fix: raised at once instead of buffered.
_CLIENT_ERRORS = ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "BAD_REQUEST")


class StoreUnavailableError(RuntimeError):
    """The MLflow store did not take buffered writes in time; names the file they were saved to."""


def _retryable(err: BaseException) -> bool:
    """Returns True for a store error worth waiting out (the store is down), False for a bad request."""
    return not (isinstance(err, MlflowException) and err.error_code in _CLIENT_ERRORS)


ARTIFACTS_DIR = "mlartifacts"  # beside a sqlite store's file: the artifacts of the experiments rlray creates there


def artifact_location(uri: str, experiment: str) -> str | None:
    """Returns where a new experiment of the store ``uri`` keeps its runs' artifacts: for a sqlite file, the folder
    ``<the file's folder>/mlartifacts/<experiment>`` (a file URI; characters other than letters, digits, '.', '-'
    and '_' in the name become '_'), so that they sit with the store rather than in ``./mlruns`` of whatever folder
    the command ran in (MLflow's default); None for other stores (a tracking server's own artifact root) and
    in-memory sqlite. An experiment that exists keeps the location it was created with.
    """
    prefix = "sqlite:///"
    db = uri[len(prefix) :].split("?", 1)[0] if uri.startswith(prefix) else ""
    if db in ("", ":memory:"):
        return None
    return (Path(db).resolve().parent / ARTIFACTS_DIR / re.sub(r"[^\w.-]", "_", experiment)).as_uri()


def _experiment_id(client: MlflowClient, name: str, uri: str) -> str:
    """Returns the id of experiment ``name`` in the store ``uri``, created when missing (another process may create it
    first) with its artifacts at ``artifact_location``."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location(uri, name))
    except MlflowException as err:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        log.debug("experiment %r was created by another process (%s)", name, err.error_code)
        return exp.experiment_id


class Tracker:
    """Writes one MLflow run: params, per-step metrics, tags and artifacts; buffers writes while the store is down.

    Safe to share between threads (the learner's heartbeat thread and its step loop): one write at a time, so
    each metric is written once and one outage is counted once.

    Args:
        uri: MLflow tracking URI (``tracking.mlflow_uri``, already resolved).
        experiment: experiment name; created when missing (a sqlite store's with its artifacts beside the file,
            ``artifact_location``).
        run_id: continue this run (resume) instead of creating one.
        run_name: name of a new run.
        client: the ``MlflowClient`` to write through (tests inject a failing one); None makes one for ``uri``.
        tensorboard_dir: also write every metric to TensorBoard in ``<tensorboard_dir>/<run id>``
            (``tracking.tensorboard_dir``); None: MLflow only.

    Raises:
        mlflow.exceptions.MlflowException: the store cannot be reached at start (the run must not start blind).
    """

    def __init__(self, uri: str, experiment: str, *, run_id: str | None = None, run_name: str | None = None,
                 client: MlflowClient | None = None, tensorboard_dir: str | Path | None = None) -> None:
        self.uri = uri
        self.client = client or _client(uri)
        self.experiment_id = _experiment_id(self.client, experiment, uri)
        if run_id is None:
            run = self.client.create_run(self.experiment_id, run_name=run_name)
            run_id = run.info.run_id
        self.run_id = run_id
        self._metrics: list[Metric] = []  # written in order, oldest first
        self._tags: dict[str, str] = {}
        self._texts: list[tuple[str, str]] = []
        self._tables: list[tuple[dict[str, list], str]] = []  # (columns, artifact file)
        self._down_since: float | None = None
        self.outages = 0  # outages of the store seen (a failed write after a good one), over this Tracker's life
        self._outages_taken = 0
        self._key = KeySanitizer()
        self.tensorboard_dir = None if tensorboard_dir is None else Path(tensorboard_dir) / run_id
        self._tb = None  # the SummaryWriter, opened at the first metric
        self._tb_lock = threading.Lock()  # the heartbeat thread logs metrics too
        # One writer at a time: the heartbeat thread and the step loop both log. Without it two flushes write the
        # same buffered metrics twice and delete some never written, and a write that began before an outage and
        # ends after another thread saw it fail marks the store back, so one outage is counted twice.
        self._lock = threading.RLock()

    @property
    def pending(self) -> int:
        """Returns how many metrics, tags and artifacts wait for the store."""
        return len(self._metrics) + len(self._tags) + len(self._texts) + len(self._tables)

    def log_config(self, cfg: LoggedConfig) -> None:
        """Logs the flattened config as params and the resolved YAML as ``config/resolved.yaml``.

        Raises:
            mlflow.exceptions.MlflowException: the store is down (called before the run starts).
        """
        params = [Param(k, str(v)[:6000]) for k, v in sorted(cfg.flat().items())]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_text(self.run_id, cfg.to_yaml(), "config/resolved.yaml")
        self.set_tags({"rlray.config_hash": cfg.config_hash()})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Logs ``metrics`` at ``step`` (buffered while the store is down); non-finite values are logged as they are.

        Keys are sanitised (``metrics.sanitize_key``: characters MLflow rejects become '_'). With ``tensorboard_dir``
        the same keys, values, step and time go to TensorBoard at once.

        Raises:
            ValueError: two different keys of this run become the same MLflow key (``KeySanitizer``).
        """
        ts = int(time.time() * 1000)
        with self._lock:
            batch = [Metric(self._key(k), float(v), ts, step) for k, v in metrics.items()]
            self._metrics.extend(batch)
            if self.tensorboard_dir is not None:
                self._write_tensorboard(batch)
            self.flush()

    def _write_tensorboard(self, batch: list[Metric]) -> None:
        with self._tb_lock:
            if self._tb is None:
                from torch.utils.tensorboard import SummaryWriter  # deferred: only runs with tracking.tensorboard_dir

                self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir))
            for m in batch:
                self._tb.add_scalar(m.key, m.value, global_step=m.step, walltime=m.timestamp / 1000)
            self._tb.flush()

    def log_samples(self, samples: list[StepSample], step: int) -> None:
        """Logs a step's kept rollouts as the table ``samples/step_<step:06d>.json`` (``mlflow.log_table``,
        buffered while the store is down); nothing when ``samples`` is empty."""
        if samples:
            columns = table_columns(samples)
            with self._lock:
                self._tables.append((columns, f"samples/step_{step:06d}.json"))
                self.flush()

    def log_ledger(self, prompt_ids: list[str], step: int) -> None:
        """Logs the prompt ledger of 1-based ``step`` as ``ledger/step_<step:06d>.json`` (``{"step", "prompt_ids"}``,
        buffered while the store is down). A step run again (after a restart or a rollback) replaces its own file.

        Args:
            prompt_ids: the ids of the prompts the step took from the data stream, in the order taken (its own,
                then DAPO refills; evaluation prompts are not in it).
            step: the 1-based step.
        """
        self.log_text(json.dumps({"step": step, "prompt_ids": list(prompt_ids)}), f"{LEDGER_DIR}/step_{step:06d}.json")

    def take_outages(self) -> int:
        """Returns the outages of the store that began since the previous call (0 at the first call without one)."""
        with self._lock:
            new, self._outages_taken = self.outages - self._outages_taken, self.outages
        return new

    def set_tags(self, tags: dict[str, str]) -> None:
        """Sets run tags (string values; buffered while the store is down, the last value of a key wins)."""
        with self._lock:
            self._tags.update({k: str(v) for k, v in tags.items()})
            self.flush()

    def log_text(self, text: str, artifact_file: str) -> None:
        """Stores ``text`` as an artifact at ``artifact_file`` (buffered while the store is down)."""
        with self._lock:
            self._texts.append((text, artifact_file))
            self.flush()

    def flush(self) -> bool:
        """Writes everything buffered; returns True when nothing is left.

        Raises:
            mlflow.exceptions.MlflowException: the store rejected a write as invalid (not an outage).
        """
        with self._lock:
            return self._flush()

    def _flush(self) -> bool:
        try:
            while self._metrics:
                self.client.log_batch(self.run_id, metrics=self._metrics[:500])
                del self._metrics[:500]
            if self._tags:
                self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in self._tags.items()])
                self._tags.clear()
            while self._texts:
                self.client.log_text(self.run_id, *self._texts[0])
                self._texts.pop(0)
            while self._tables:
                self.client.log_table(self.run_id, *self._tables[0])
                self._tables.pop(0)
        except Exception as err:
            if not _retryable(err):
                raise
            if self._down_since is None:
                self._down_since = time.monotonic()
                self.outages += 1
                log.warning("MLflow store %s is unreachable (%s: %s); buffering metrics, tags and artifacts until it "
                            "returns, the run goes on", self.uri, type(err).__name__, str(err)[:300])
            return False
        if self._down_since is not None:
            log.warning("MLflow store %s is back after %.0f s; the buffered metrics, tags and artifacts were written",
                        self.uri, time.monotonic() - self._down_since)
            self._down_since = None
        return True

    def close(self, *, wait_s: float = 60.0, spill_path: str | Path | None = None) -> None:
        """Closes the TensorBoard writer, then writes what is buffered, retrying for up to ``wait_s`` seconds
        while the store is down.

        Args:
            wait_s: how long to wait for the store, in seconds.
            spill_path: where to save what could not be written (JSON Lines: one {"kind": "metric" | "tag" |
                "text" | "table", ...} per line); None puts ``mlflow-unsent-<run id>.jsonl`` in the working folder.

        Raises:
            StoreUnavailableError: the store stayed down; the message names the file with the unsent records.
        """
        with self._tb_lock:
            if self._tb is not None:
                self._tb.close()
                self._tb = None  # a metric logged after this opens a new event file in the same folder
        with self._lock:
            self._close(wait_s, spill_path)

    def _close(self, wait_s: float, spill_path: str | Path | None) -> None:
        if not self.pending:
            return
        retrying = Retrying(stop=stop_after_delay(wait_s), wait=wait_exponential(multiplier=0.5, max=10.0),
                            retry=retry_if_exception_type(StoreUnavailableError), reraise=True)
        try:
            retrying(self._flush_or_raise)
        except StoreUnavailableError:
            path = Path(spill_path or f"mlflow-unsent-{self.run_id}.jsonl")
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as out:
                for m in self._metrics:
                    out.write(json.dumps({"kind": "metric", "key": m.key, "value": m.value, "timestamp": m.timestamp,
                                          "step": m.step}) + "\n")
                out.writelines(json.dumps({"kind": "tag", "key": k, "value": v}) + "\n" for k, v in self._tags.items())
                out.writelines(json.dumps({"kind": "text", "file": f, "text": t}) + "\n" for t, f in self._texts)
                out.writelines(json.dumps({"kind": "table", "file": f, "columns": c}) + "\n" for c, f in self._tables)
            count = self.pending
            self._metrics, self._tags, self._texts, self._tables = [], {}, [], []
            raise StoreUnavailableError(
                f"MLflow store {self.uri} stayed unreachable for {wait_s:g} s at the end of run {self.run_id}; "
                f"{count} unsent metrics/tags/artifacts were saved to {path.resolve()}"
            ) from None

    def _flush_or_raise(self) -> None:
        if not self.flush():
            raise StoreUnavailableError("the store is down")

    def finish(self, status: str = "FINISHED") -> None:
        """Writes what is buffered (``close``), then ends the run with ``status`` (FINISHED, FAILED or KILLED)."""
        self.close()
        self.client.set_terminated(self.run_id, status=status)

    def finish_unless_ended(self, status: str, tags: dict[str, str] | None = None) -> str:
        """Ends the run with ``status`` and ``tags`` unless it was already ended; returns the status it ends with.

        Writes what is buffered first (``close``). A run that someone else already ended keeps its status:
        a sweep's ``TrialRunCloser`` ends the run of a trial the scheduler stopped (KILLED) before Tune
        stops the trial's process, and that process, dying, must not overwrite it with FAILED. When the
        status cannot be read (store down), the run is ended as asked.

        Raises:
            StoreUnavailableError: the store stayed down (``close``).
        """
        self.close()
        try:
            current = self.client.get_run(self.run_id).info.status
        except Exception as err:
            if not _retryable(err):
                raise
            current = "RUNNING"
        if current != "RUNNING":
            log.info("MLflow run %s was already ended as %s; not ending it again as %s", self.run_id, current, status)
            return current
        if tags:
            self.set_tags(tags)
        self.finish(status)
        return status

    def tags(self) -> dict[str, str]:
        """Returns the run's tags, buffered ones included (a read: raises while the store is down)."""
        return {**self.client.get_run(self.run_id).data.tags, **self._tags}

    def last_logged_step(self, key: str = "timing/step_s") -> int:
        """Returns the highest step at which ``key`` was logged in this run, 0 when never."""
        return max((m.step for m in self.client.get_metric_history(self.run_id, key)), default=0)

    def register_model_version(self, name: str, source: str, tags: dict[str, str]) -> str:
        """Registers ``source`` as a new version of registered model ``name`` (created when missing); returns the version."""
        try:
            self.client.create_registered_model(name, description="rlray snapshots; lineage in version tags")
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        mv = self.client.create_model_version(name, source=source, run_id=self.run_id,
                                              tags={k: str(v)[:5000] for k, v in tags.items()})
        return str(mv.version)


def model_versions(uri: str, name: str, *, run_id: str | None = None, tag: tuple[str, str] | None = None) -> list[dict]:
    """Returns the versions of registered model ``name`` (optionally of one run, or with one tag value),
    oldest first, each as {version, run_id, source, tags}."""
    client = _client(uri)
    query = f"name='{name}'"
    if run_id:
        query += f" and run_id='{run_id}'"
    if tag:
        query += f" and tags.`{tag[0]}`='{tag[1]}'"
    found = client.search_model_versions(query)
    rows = [{"version": str(v.version), "run_id": v.run_id, "source": v.source, "tags": dict(v.tags)} for v in found]
    return sorted(rows, key=lambda r: int(r["version"]))


def model_version(uri: str, name: str, version: str) -> dict:
    """Returns one version of registered model ``name`` as {version, run_id, source, tags}."""
    v = _client(uri).get_model_version(name, version)
    return {"version": str(v.version), "run_id": v.run_id, "source": v.source, "tags": dict(v.tags)}


def get_run_metrics(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Returns {metric key: [(step, value), ...]} of a run, sorted by step (for tests and eval tools)."""
    client = _client(uri)
    keys = client.get_run(run_id).data.metrics.keys()
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def get_run(uri: str, run_id: str) -> mlflow.entities.Run:
    """Returns the MLflow run entity (params, tags, status)."""
    return _client(uri).get_run(run_id)


def child_runs(
    uri: str, *, parent_run_id: str | None, trial_id: str | None = None, experiment: str | None = None
) -> list[mlflow.entities.Run]:
    """Returns sweep trial runs, oldest first: children of ``parent_run_id`` and/or of Tune trial ``trial_id``.

    The search covers the parent's experiment, or ``experiment`` (a name) when no parent is given.
    """
    client = _client(uri)
    if parent_run_id:
        experiment_id = client.get_run(parent_run_id).info.experiment_id
    else:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return []
        experiment_id = exp.experiment_id
    filters = [f"tags.`mlflow.parentRunId` = '{parent_run_id}'"] if parent_run_id else []
    filters += [f"tags.`rlray.tune_trial_id` = '{trial_id}'"] if trial_id else []
    return client.search_runs([experiment_id], filter_string=" and ".join(filters), order_by=["attributes.start_time ASC"])


SAMPLES_DIR = "samples"  # artifact folder of the kept samples (``Tracker.log_samples``)
LEDGER_DIR = "ledger"  # artifact folder of the per-step prompt ledger (``Tracker.log_ledger``)


def read_ledger(uri: str, run_id: str) -> dict[int, list[str]]:
    """Returns {1-based step: prompt ids, in the order taken} of run ``run_id`` from its ``ledger/step_<step>.json``
    artifacts (``Tracker.log_ledger``), steps ascending; {} when the run has none.

    Raises:
        mlflow.exceptions.MlflowException: the run does not exist, or the store is down.
        ValueError: a ledger file names another step than its file name.
    """
    import tempfile

    client = _client(uri)
    names = [f.path.rsplit("/", 1)[-1] for f in client.list_artifacts(run_id, LEDGER_DIR) if not f.is_dir]
    if not names:  # no ledger folder: downloading it would fail
        return {}
    ledger: dict[int, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="rlray-ledger-") as tmp:
        local = Path(client.download_artifacts(run_id, LEDGER_DIR, tmp))
        for name in names:
            if not re.fullmatch(r"step_\d+\.json", name):
                continue
            record = json.loads((local / name).read_text(encoding="utf-8"))
            if record["step"] != int(name[5:-5]):
                raise ValueError(f"ledger file {LEDGER_DIR}/{name} of run {run_id} says step {record['step']}")
            ledger[record["step"]] = [str(p) for p in record["prompt_ids"]]
    return dict(sorted(ledger.items()))


def sample_steps(uri: str, run_id: str) -> list[int]:
    """Returns the steps of run ``run_id`` that have a samples table (``samples/step_<step>.json``), ascending."""
    files = _client(uri).list_artifacts(run_id, SAMPLES_DIR)
    names = [f.path.rsplit("/", 1)[-1] for f in files if not f.is_dir]
    return sorted(int(n[5:-5]) for n in names if re.fullmatch(r"step_\d+\.json", n))


def read_artifact_json(uri: str, run_id: str, path: str) -> object:
    """Returns the parsed JSON artifact ``path`` of run ``run_id`` (e.g. ``samples/step_000003.json``).

    Raises:
        mlflow.exceptions.MlflowException: the run or the file does not exist, or the store is down.
        json.JSONDecodeError: the file is not JSON.
    """
    return json.loads(read_artifact_text(uri, run_id, path))


def read_artifact_text(uri: str, run_id: str, path: str) -> str:
    """Returns the text of artifact ``path`` of run ``run_id`` (UTF-8), downloaded to a temporary folder.

    Raises:
        mlflow.exceptions.MlflowException (or OSError from the artifact store): no such run or file.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rlray-artifact-") as tmp:
        return Path(_client(uri).download_artifacts(run_id, path, tmp)).read_text(encoding="utf-8")


def last_metric_time_s(uri: str, run_id: str, key: str) -> float | None:
    """Returns when metric ``key`` of run ``run_id`` was last logged (Unix seconds), None when never."""
    history = _client(uri).get_metric_history(run_id, key)
    return max((m.timestamp for m in history), default=None) / 1000.0 if history else None


def metrics_by_step(uri: str, run_id: str) -> dict[int, dict[str, float]]:
    """Returns {step: {metric key: value}} of run ``run_id``, steps ascending.

    Where a key was logged twice at one step (a rollback or a restart ran the step again), the later write wins,
    as on the live page.
    """
    client = _client(uri)
    steps: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            steps.setdefault(m.step, {})[key] = m.value
    return dict(sorted(steps.items()))
