"""Shared pytest fixtures: the repository root, real GSM8K rows and hh-rlhf pairs, and the tiny random model."""

from __future__ import annotations

import contextlib
import math
import os
import re
from pathlib import Path

import pytest
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may reach the Hugging Face hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]

# Hypothesis: ``make test`` (CI) runs the "ci" profile, derandomized (each test's examples derive from the test
# itself, so every run and every machine draws the same ones); ``make test-slow`` runs "explore" (a new random
# search each run, more examples), so the search still goes on outside CI. Pinned failures are ``@example``s.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, max_examples=100, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_RAY_WORDS: re.Pattern[str] | None = None


def _uses_ray(test_file: str) -> bool:
    """True when the test module (a path relative to the repository) or a conftest.py beside it or above it (short of
    this one) marks a test ``ray`` or asks for the ``ray_session`` cluster, directly or through a fixture of this file
    that needs it."""
    global _RAY_WORDS
    if _RAY_WORDS is None:
        here = Path(__file__).read_text()
        needing = re.findall(r"^def (\w+)\([^)]*\bray_session\b", here, flags=re.M)
        _RAY_WORDS = re.compile(r"\bmark\.ray\b|\b(?:" + "|".join(["ray_session", *needing]) + r")\b")
    path = REPO_ROOT / test_file
    files = [path] + [d / "conftest.py" for d in path.parents if d != REPO_ROOT / "tests" and REPO_ROOT / "tests" in d.parents]
    return any(_RAY_WORDS.search(f.read_text()) for f in files if f.is_file())


RAY_SECONDS_FILE = REPO_ROOT / "tests" / "ray_module_seconds.json"
UNMEASURED_RAY_MODULE_S = 60.0  # a Ray module not in RAY_SECONDS_FILE yet counts as this many seconds


def ray_groups(modules: list[str], groups: int, seconds: dict[str, float], together: list[frozenset[str]] = (),
               shares: list[float] | None = None) -> dict[str, int]:
    """Splits the Ray test modules into ``groups`` groups of about equal measured time (longest first, each to the
    group with the least time so far: LPT, Graham 1969); returns {module: group index}.

    Args:
        modules: test module paths relative to the repository (``tests/run/test_x.py``).
        groups: how many groups (>= 1).
        seconds: measured seconds per module (``RAY_SECONDS_FILE``); a module missing from it counts as
            ``UNMEASURED_RAY_MODULE_S``.
        together: sets of modules that must each share one group (one item of their summed time): those that start
            Ray Serve, whose HTTP proxy takes one port of the machine (``reward.server.port``, 8000 by default), and
            those that use one session fixture's run (``tiny_sweep``: it would run once in each group).
            Overlapping sets are merged.
        shares: each group's part of the time (any positive numbers; equal when None): each item goes to the group
            whose load after it, divided by its share, is least (LPT on machines of different speeds).

    Raises:
        ValueError: ``shares`` not one positive number per group.
    """
    if shares is None:
        shares = [1.0] * groups
    if len(shares) != groups or min(shares, default=1.0) <= 0:
        raise ValueError(f"shares={shares!r}: give one positive number per group ({groups})")
    def cost(module: str) -> float:
        return seconds.get(module, UNMEASURED_RAY_MODULE_S)

    bundles: list[set[str]] = []
    for bundle in together:
        bundle = set(bundle) & set(modules)
        for other in [b for b in bundles if b & bundle]:
            bundle |= other
            bundles.remove(other)
        if bundle:
            bundles.append(bundle)
    bundled = set().union(*bundles)
    items = [[m] for m in modules if m not in bundled] + [sorted(b) for b in bundles]
    load = [0.0] * groups
    out: dict[str, int] = {}
    for item in sorted(items, key=lambda ms: (-sum(map(cost, ms)), ms)):
        item_s = sum(map(cost, item))
        group = min(range(groups), key=lambda g: ((load[g] + item_s) / shares[g], g))
        out.update(dict.fromkeys(item, group))
        load[group] += sum(map(cost, item))
    return out


_SERVE_WORDS = re.compile(r"\bserve\.(?:start|run|delete|shutdown|status)\b|reward\.server\.enabled|\bdeploy_judges\b|"
                          r"\bstart_reward_server\b|\bserve_reward\b")


def _uses_serve(test_file: str) -> bool:
    """True when the test module starts Ray Serve (its words: ``serve.start``/``serve.run``/..., ``reward.server.enabled``,
    ``deploy_judges``, ``start_reward_server``)."""
    return bool(_SERVE_WORDS.search((REPO_ROOT / test_file).read_text()))


TAIL_RAY_SHARE = 0.33  # on 2 workers, the part of the Ray modules' measured time that runs after the pure modules


def _shared_run_users() -> list:
    """Returns, per session fixture of this file that needs the Ray cluster (``tiny_sweep``: a whole sweep), a test
    that is True for a module that uses it: such modules share a group, or the fixture's run would happen in each."""
    here = Path(__file__).read_text()
    names = re.findall(r'^@pytest\.fixture\(scope="session"\)\ndef (\w+)\([^)]*\bray_session\b', here, flags=re.M)
    return [lambda m, word=re.compile(rf"\b{name}\b"): bool(word.search((REPO_ROOT / m).read_text())) for name in names]


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Schedules ``make test``'s workers (``pytest -n N``) by module. The modules that use Ray (``_uses_ray``) form
    groups of measured time (``ray_groups`` on ``RAY_SECONDS_FILE``); each group runs, in order, on one worker and its
    one Ray cluster. The modules that start Ray Serve share one group (its HTTP proxy takes a port of the machine).

    - On 2 workers (``make test``): a head group of ``1 - TAIL_RAY_SHARE`` of the time starts first on one worker; the
      pure modules run on the other, and then the tail group (``TAIL_RAY_SHARE``, env ``RLRAY_TAIL_RAY_SHARE``)
      on whichever worker is free first. A Ray run alone leaves part of the 2 cores idle (its actors wait on one
      another), so the pure worker's idle end takes the tail, while two Ray groups at once from the start were
      measured slower (their start-ups fight over the 2 cores).
    - On N > 2 workers: N-1 groups of equal time start first; the pure modules go to the remaining worker and to
      whichever worker is free.

    xdist's own ``--dist loadgroup`` cannot do this under pytest 9.2 (it renames test ids through an attribute pytest
    no longer reads)."""
    import json

    from xdist.scheduler import LoadScopeScheduling

    workers = int(config.getoption("numprocesses") or 1)
    seconds = json.loads(RAY_SECONDS_FILE.read_text()) if RAY_SECONDS_FILE.is_file() else {}
    tail_share = float(os.environ.get("RLRAY_TAIL_RAY_SHARE", TAIL_RAY_SHARE)) if workers == 2 else 0.0
    groups = 2 if workers == 2 and tail_share > 0 else max(1, workers - 1)
    shares = [1.0 - tail_share, tail_share] if groups == 2 and workers == 2 else None
    tail = f"ray:{groups - 1}" if shares else None
    cache: dict[str, str] = {}

    class RayModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module not in cache:
                cache[module] = "ray" if _uses_ray(module) else module
            return cache[module]

        def schedule(self) -> None:
            if self.collection is None and self.collection_is_completed:  # the first call: group the Ray modules
                modules = [m for m, scope in cache.items() if scope == "ray"]
                if not modules:  # _split_scope has not run yet: fill the cache from a worker's collection
                    for nodeid in next(iter(self.registered_collections.values())):
                        self._split_scope(nodeid)
                    modules = [m for m, scope in cache.items() if scope == "ray"]
                together = [frozenset(m for m in modules if _uses_serve(m))]
                together += [frozenset(m for m in modules if uses(m)) for uses in _shared_run_users()]
                for module, group in ray_groups(modules, groups, seconds, together, shares).items():
                    cache[module] = f"ray:{group}"
            super().schedule()

        def _assign_work_unit(self, node) -> None:
            head = [scope for scope in self.workqueue if scope.startswith("ray:") and scope != tail]
            if head:  # the longest units first, one per worker: a head group never waits behind pure modules
                self.workqueue.move_to_end(head[0], last=False)
            if tail in self.workqueue and len(self.workqueue) > 1:  # the tail group last
                self.workqueue.move_to_end(tail)
            super()._assign_work_unit(node)

    return RayModulesTogether(config, log)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With RLRAY_STORE_RAY_SECONDS=1 (``make test-seconds``), adds each test's time to its module's total."""
    if os.environ.get("RLRAY_STORE_RAY_SECONDS") == "1" and not os.environ.get("PYTEST_XDIST_WORKER"):
        module = report.nodeid.split("::", 1)[0]
        _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


_MODULE_SECONDS: dict[str, float] = {}


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With RLRAY_STORE_RAY_SECONDS=1, writes the Ray modules' measured seconds to ``RAY_SECONDS_FILE`` (the
    controller process only; the workers report to it)."""
    if os.environ.get("RLRAY_STORE_RAY_SECONDS") != "1" or os.environ.get("PYTEST_XDIST_WORKER") or not _MODULE_SECONDS:
        return
    import json

    measured = {m: round(s, 1) for m, s in sorted(_MODULE_SECONDS.items()) if _uses_ray(m)}
    RAY_SECONDS_FILE.write_text(json.dumps(measured, indent=1) + "\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips tests marked ``gpu`` when CUDA is not available (a marker, so the reason shows in the report)."""
    import torch

    if torch.cuda.is_available():
        return
    needs_cuda = pytest.mark.skipif(True, reason="marked gpu: needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(needs_cuda)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """Returns the repository root (the folder holding pyproject.toml)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def gsm8k_dir(repo_root: Path) -> Path:
    """Returns <repo>/data/gsm8k with train.jsonl and test.jsonl, fetched from the data mirror if missing.

    The mirror is env RLRAY_DATA_MIRROR, or <repo>/../shared/data when that is unset.
    """
    from rlray.data.fetch import MIRROR_ENV, fetch_dataset

    with pytest.MonkeyPatch.context() as patch:
        if not os.environ.get(MIRROR_ENV):
            patch.setenv(MIRROR_ENV, str(repo_root.parent / "shared" / "data"))
        return fetch_dataset("gsm8k", repo_root / "data")


@pytest.fixture(scope="session")
def hh_rlhf_dir(repo_root: Path) -> Path:
    """Returns <repo>/data/hh-rlhf-harmless with test.jsonl.gz, fetched from the data mirror if missing."""
    from rlray.data.fetch import MIRROR_ENV, fetch_dataset

    with pytest.MonkeyPatch.context() as patch:
        if not os.environ.get(MIRROR_ENV):
            patch.setenv(MIRROR_ENV, str(repo_root.parent / "shared" / "data"))
        return fetch_dataset("hh-rlhf-harmless", repo_root / "data")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """Returns the folder of the 'tiny-random' model (built once into rlray's cache, then reused)."""
    from rlray.models.loading import resolve_model_path

    return resolve_model_path("tiny-random")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path: str):
    """Returns the tokenizer of the 'tiny-random' model (SmolLM2's, with its chat template; pad == eos)."""
    from rlray.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_path)


_RAY_SESSION_STARTED = False  # set by ray_session: from then on this process's Ray is the session's cluster


@pytest.fixture(autouse=True)
def _no_ray_outside_the_ray_group(request: pytest.FixtureRequest):
    """Fails a test that left a Ray cluster of its own behind (``ray.init``, or Ray's auto-init on a first
    ``ray.remote``/``ray.get``) without the ``ray`` marker or the ``ray_session`` fixture: under pytest-xdist it would
    start a second cluster on the worker that runs the pure tests."""
    yield
    import sys

    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: the Ray tests and the pure ones share it anyway
        return
    ray = sys.modules.get("ray")
    if ray is None or _RAY_SESSION_STARTED or request.node.get_closest_marker("ray") is not None:
        return
    if ray.is_initialized():
        ray.shutdown()
        pytest.fail(f"{request.node.nodeid} started Ray without the ray marker or the ray_session fixture: mark it "
                    "@pytest.mark.ray (or use ray_session) so that it runs in the Ray tests' group")


@pytest.fixture(scope="session")
def ray_session():
    """Starts one local Ray cluster for the whole test session (no dashboard) and shuts it down after."""
    import ray

    global _RAY_SESSION_STARTED
    _RAY_SESSION_STARTED = True
    from rlray.launch.ray_setup import EMBEDDED_RAY_SYSTEM_CONFIG, embedded_ray_env

    ray.init(include_dashboard=False, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                                                                **embedded_ray_env()}},
             _system_config=dict(EMBEDDED_RAY_SYSTEM_CONFIG))
    yield ray
    ray.shutdown()



@contextlib.contextmanager
def moto_server(**env: str):
    """Runs moto's S3 API in a child process on a free 127.0.0.1 port with an empty bucket 'rlray-test'.

    Yields {"endpoint_url", "key", "secret", "region", "bucket"}. A child process, not moto's threaded
    server: that one imports flask into the test process, and vLLM's CPU start-up scans every module's
    globals, which flask's request proxies refuse outside a request (RuntimeError in the engine tests).
    ``env`` is added to the child's environment (``INITIAL_NO_AUTH_ACTION_COUNT="0"`` makes moto check
    credentials like AWS: then no key is valid and the bucket is not created).
    """
    import socket
    import subprocess
    import sys
    import time

    import s3fs

    from rlray.rollout.weight_sync import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    info = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing", "region": "us-east-1",
            "bucket": "rlray-test"}
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=info["endpoint_url"],
                           client_kwargs={"region_name": "us-east-1"}, skip_instance_cache=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start on 127.0.0.1:{port}") from None
                time.sleep(0.2)
        if env.get("INITIAL_NO_AUTH_ACTION_COUNT") != "0":
            fs.call_s3("create_bucket", Bucket="rlray-test")
        yield info
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def moto_s3():
    """Returns a real S3 API on 127.0.0.1 (moto in server mode, a child process) with an empty bucket 'rlray-test'.

    Yields {"endpoint_url", "key", "secret", "region", "bucket"}; tests reach it through s3fs.
    """
    with moto_server() as info:
        yield info


@pytest.fixture
def moto_s3_checking_keys():
    """Returns an S3 API like ``moto_s3`` that checks credentials as AWS does (no key is valid; no bucket)."""
    with moto_server(INITIAL_NO_AUTH_ACTION_COUNT="0") as info:
        yield info


class FakeRayStart:
    """Stands in for ``rlray.launch.ray_setup.RayStart`` in tests of runs that must fail their input checks: records
    whether the run waited for Ray (``result``, which fails the test) and whether it shut Ray down again (``cancel``)."""

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.cancelled = kwargs, False

    def result(self):
        pytest.fail("the run went on to use Ray although its inputs failed the checks")

    def cancel(self) -> None:
        self.cancelled = True


@pytest.fixture
def ray_starts(monkeypatch) -> list[FakeRayStart]:
    """Replaces ``RayStart`` (``rlray train`` and ``run_training`` start Ray beside their input checks; issue 39) and
    returns the starts asked for: a run that fails its checks must cancel each and never wait for one. Ray does not start."""
    from rlray.launch import ray_setup

    starts: list[FakeRayStart] = []

    def make(**kwargs) -> FakeRayStart:
        starts.append(FakeRayStart(**kwargs))
        return starts[-1]

    monkeypatch.setattr(ray_setup, "RayStart", make)
    return starts


@pytest.fixture(scope="session")
def tiny_sweep(ray_session, tmp_path_factory, gsm8k_dir, tiny_model_path):
    """Runs one 2-trial ASHA sweep (grid over learner.lr, up to 2 steps each, tiny-random); returns (result, uri, sweep).

    Trials run one at a time, lr=1e-4 first. The ranking metric is learner/lr with mode 'min', so
    the outcome is known in advance: at the rung after step 1 the lr=1e-3 trial is worse than the
    first trial and ASHA stops it; the lr=1e-4 trial runs both steps. Shared by the sweep test and
    the analysis-notebook test. The rollout uses the transformers backend: the subject is the Tune
    wiring, and vLLM's start-up is covered by run/test_online_e2e.
    """
    from rlray.config import load_config
    from rlray.sweep.spec import SweepConfig
    from rlray.sweep.tune import run_sweep

    folder = tmp_path_factory.mktemp("sweep")
    uri = f"sqlite:///{folder}/mlflow.db"
    cfg = load_config(
        REPO_ROOT / "configs/grpo_gsm8k_tiny.yaml",
        [f"run.output_dir={folder}/out", f"tracking.mlflow_uri={uri}", f"data.train_files=[{gsm8k_dir}/train.jsonl]",
         f"data.eval_files=[{gsm8k_dir}/test.jsonl]", "run.max_steps=2", "eval.num_problems=0", "rollout.backend=hf",
         "run.name=lr-sweep", "tracking.experiment=sweeps"],
    )
    sweep = SweepConfig.model_validate(
        {"metric": "learner/lr", "mode": "min", "space": {"learner.lr": {"grid": [1e-4, 1e-3]}},
         "scheduler": {"name": "asha", "grace_period_steps": 1, "reduction_factor": 2}, "max_concurrent_trials": 1}
    )
    return run_sweep(cfg, sweep), uri, sweep


class ListQueue(list):
    """A ray.util.queue.Queue stand-in for one process: put appends, get pops the oldest (IndexError when empty)."""

    def put(self, item):
        self.append(item)

    def get(self):
        return self.pop(0)


@pytest.fixture
def list_queue() -> type[ListQueue]:
    """The ``ListQueue`` class: a queue stand-in for Tune's step reporter tests."""
    return ListQueue


@pytest.fixture
def tiny_grpo_run(tmp_path, gsm8k_dir):
    """A function that runs configs/grpo_gsm8k_tiny.yaml for 3 steps with extra overrides and a length reward
    (a random model never solves GSM8K), asserts the main-job checks shared by the end-to-end tests (run
    FINISHED, each of ``required`` metric keys logged at steps 1-3 and declared in rlray.observe.metrics, finite losses)
    and returns (MLflow uri, result, metrics)."""
    from rlray.config import RewardFunctionConfig, load_config
    from rlray.launch.driver import run_training
    from rlray.observe.metrics import METRIC_KEYS, term_keys
    from rlray.observe.tracking import get_run_metrics

    def run(required: list[str], *overrides: str):
        uri = f"sqlite:///{tmp_path}/mlflow.db"
        cfg = load_config(
            REPO_ROOT / "configs/grpo_gsm8k_tiny.yaml",
            [f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}", f"data.train_files=[{gsm8k_dir}/train.jsonl]",
             f"data.eval_files=[{gsm8k_dir}/test.jsonl]", "run.max_steps=3", "learner.lr=1e-3", *overrides],
        )
        cfg.reward.functions = [
            RewardFunctionConfig(function=f"{REPO_ROOT}/tests/fixtures/rewards.py:completion_length", weight=1.0)
        ]
        result = run_training(cfg)
        assert result.status == "FINISHED"
        metrics = get_run_metrics(uri, result.run_id)
        for key in required:
            assert key in metrics, key
            assert [s for s, _ in metrics[key]] == [1, 2, 3], key
        assert set(required) <= set(METRIC_KEYS) | set(term_keys(["completion_length"]))
        assert all(math.isfinite(v) for _, v in metrics["learner/pg_loss"] + metrics["learner/grad_norm"])
        return uri, result, metrics

    return run
