"""The reward server: the Serve application ``rlray-reward`` and the clients a run scores through.

Layers, bottom up:
- ``ScorerSandbox``: a child process (``rlray.sandbox.ProcessSandbox``, the same mechanism that
  runs each user function with its own timeout) that holds one ``RewardScorer`` (built-in verifiers, user functions,
  and the reward model when the scorer has one). A call that runs past ``timeout_s`` kills the process,
  starts a fresh one and fails with ``RewardTimeoutError``, so nothing wedges a replica (Python threads
  cannot be killed; processes can). The error carries the hang report (``rlray.hangs.Hang``: the process's stacks,
  taken before the kill), and a reply carries those of the user functions killed at their own timeouts; a client
  hands each to its ``on_hang`` (a run's ``HangWatch.killed``: the ``rlray: hang`` line and alert, or the stop).
- ``RewardService``: a plain class with a version number and a sandbox. ``swap`` builds the new
  sandbox first and only then replaces the old one, so calls keep being served during a swap.
- ``RewardDeployment``: the thin Serve deployment. ``@serve.batch`` merges concurrent requests into
  one scorer call; ``reconfigure`` (Serve's user_config) hot-swaps the scorer and its version;
  FastAPI serves ``POST /score``.
- ``LocalRewardClient`` / ``ServeRewardClient``: what a run calls, ``score(...) -> ScoreResult``. The
  Serve client retries with exponential back-off while no replica answers (a killed replica is restarted
  by Serve), then fails with ``RewardServerUnavailableError``.

A request carries B prompts (strings or TRL conversational message lists), B completions, B column dicts
(each sample's prompt row's other columns, passed to the reward functions as keyword lists) and, optionally,
B completion token-id lists; ``rlray.reward.scorer`` describes how they are scored. A term's value is a
float, NaN (*failed*: the function raised, timed out or returned NaN/inf; NaN in "reward" too, and the run
counts the sample in ``reward/failed`` and leaves it out) or None (*skipped*: the function returned None,
the term does not apply). JSON has no NaN, so the HTTP reply keeps the two apart by writing NaN as the
string ``"NaN"`` and None as ``null`` (``ScoreReply``: ``ser_json_inf_nan="strings"``);
``ScoreReply.model_validate_json`` reads ``"NaN"`` back as a float NaN, and so does ``ServeRewardClient``.

Hot swap: deploying the application again with a new user_config (``{"version": v, "scorer": kwargs}``,
e.g. a new reward-model path in the kwargs) makes Serve call ``reconfigure`` on the running replicas
in place; requests are never dropped (see tests/reward/test_server.py).

The scorer is built as ``RewardScorer(**scorer_kwargs)``; any argument the scorer accepts (a reward
model path, say) travels through the kwargs unchanged.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from tenacity import RetryError, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from rlray.hangs import ALERT_STACK_CHARS, ActorProcess, Hang, enable_stack_dumps
from rlray.reward.scorer import RewardFunctionError, RewardScorer
from rlray.sandbox import ProcessSandbox, SandboxCrashed, SandboxError, SandboxTimeout

APP_NAME = "rlray-reward"
log = logging.getLogger(__name__)
_START_TIMEOUT_S = 300.0  # loading a reward model can take minutes


class RewardTimeoutError(TimeoutError):
    """A scorer call ran past its timeout; the sandbox was restarted. Names the timeout; ``hang``: the report, with the
    scorer process's stacks taken before the kill (None when unknown)."""

    def __init__(self, message: str, hang: Hang | None = None) -> None:
        super().__init__(message)
        self.hang = hang


class RewardServerError(RuntimeError):
    """The scorer failed inside the sandbox (a bad user function, a model that cannot load)."""


class RewardServerUnavailableError(RewardServerError):
    """The reward Serve application did not answer after every retry; names the application and the attempts."""


@dataclass(frozen=True)
class ScoreResult:
    """Scores of a batch of completions and the reward version that produced them.

    Attributes:
        version: reward version (``reward.version`` of the deployed config).
        values: {"reward": [...], <term name>: [...], ("reward_model": [...])}, B each: floats, NaN where the
            sample failed, None where a term skipped it (``rlray.reward.scorer``).
        failures: B texts: "" where the reward is a number, else why it is NaN, naming the reward function
            (``RewardScorer.score_with_failures``); [] from a client that does not know them.
        outputs: {judge name: [B raw judge outputs]} when judges scored the batch (``rlray.reward.judges.panel``).
        hangs: the reports of user functions killed at their timeout in the call (``RewardScorer.watch_hangs``).
    """

    version: int
    values: dict[str, list[float | None]]
    failures: list[str] = field(default_factory=list)
    outputs: dict[str, list[str]] = field(default_factory=dict)
    hangs: list[Hang] = field(default_factory=list)


class ScoreRequest(BaseModel):
    """One scoring request, the JSON body of POST /score: B samples."""

    prompts: list[str | list[dict[str, Any]]] = Field(
        description="the prompts as the dataset has them: strings, or lists of {role, content} messages"
    )
    completions: list[str] = Field(description="the decoded completions")
    columns: list[dict[str, Any]] = Field(
        description="each sample's prompt row's other columns (e.g. {answer: ...}); keyword lists of the reward functions"
    )
    completion_ids: list[list[int]] | None = Field(None, description="the completions' token ids, or null")

    @model_validator(mode="after")
    def _same_length(self) -> ScoreRequest:
        n = len(self.completions)
        ids = None if self.completion_ids is None else len(self.completion_ids)
        if len(self.prompts) != n or len(self.columns) != n or ids not in (None, n):
            raise ValueError(
                f"prompts ({len(self.prompts)}), completions ({n}), columns ({len(self.columns)}) and "
                f"completion_ids ({ids}) must have the same length"
            )
        return self


class ScoreReply(BaseModel):
    """The reply of POST /score; in JSON, NaN (a failed sample) is the string "NaN" and None (skipped) is null."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    version: int = Field(description="reward version that scored the request")
    scores: dict[str, list[float | None]] = Field(
        description='reward terms, one value per completion: a number, "NaN" where it failed, null where skipped'
    )
    failures: list[str] = Field(
        default_factory=list,
        description='per completion: "" where the reward is a number, else why it failed (names the reward function)',
    )
    hangs: list[Hang] = Field(default_factory=list, description="user functions killed at their timeout, with stacks")


# --------------------------------------------------------------------------------------------
# Sandbox process
# --------------------------------------------------------------------------------------------
def _serve_scorer(**scorer_kwargs: Any) -> Any:
    """Sandbox factory (runs in the child): returns a new ``RewardScorer``'s ``score_with_failures`` that also returns
    the reports of the user functions killed at their timeout during the call (values, failures, hangs)."""
    scorer, hangs = RewardScorer(**scorer_kwargs), []
    scorer.watch_hangs(hangs.append)

    def score(*args: Any) -> tuple[dict[str, list[float | None]], list[str], list[Hang]]:
        try:
            values, failures = scorer.score_with_failures(*args)
            return values, failures, list(hangs)
        finally:
            hangs.clear()

    return score


class ScorerSandbox:
    """A ``RewardScorer`` in a child process (``rlray.sandbox.ProcessSandbox``), one batch at a time.

    The scorer's user functions run in sandboxes of their own inside it (with their own timeouts);
    ``timeout_s`` bounds a whole scorer call on top of that.

    Args:
        scorer_kwargs: keyword arguments of ``RewardScorer`` (plain values; they are pickled).
        timeout_s: seconds one ``score`` call may take.

    Raises:
        RewardServerError: the scorer could not be built (the message is the child's error).
        RewardTimeoutError: the child did not start within 300 s.
    """

    def __init__(self, scorer_kwargs: dict, timeout_s: float) -> None:
        self.scorer_kwargs = dict(scorer_kwargs)
        self.timeout_s = timeout_s
        try:
            self._box = ProcessSandbox(_serve_scorer, self.scorer_kwargs, timeout_s=timeout_s,
                                       start_timeout_s=_START_TIMEOUT_S, name="reward scorer")
        except SandboxTimeout:
            raise RewardTimeoutError(f"the reward scorer did not start within {_START_TIMEOUT_S:.0f} s") from None
        except SandboxError as err:
            raise RewardServerError(f"the reward scorer could not be built: {err}") from None

    def score(self, prompts: list[str | list[dict]], completions: list[str], columns: list[dict[str, Any]],
              completion_ids: list[list[int]] | None = None) -> dict[str, list[float | None]]:  # fmt: skip
        """Returns the scorer's {term: [B values]} for one batch (``score_with_reports`` without the rest)."""
        return self.score_with_reports(prompts, completions, columns, completion_ids)[0]

    def score_with_reports(self, prompts: list[str | list[dict]], completions: list[str], columns: list[dict[str, Any]],
                           completion_ids: list[list[int]] | None = None) -> tuple[dict, list[str], list[Hang]]:
        """Returns the scorer's ({term: [B values]}, [B failure texts], the reports of user functions killed at their
        timeout) for one batch (thread-safe; calls run one at a time; ``RewardScorer.score_with_failures``).

        Arguments as in ``RewardScorer.score``.

        Raises:
            RewardTimeoutError: the call ran past ``timeout_s`` (the child is killed and restarted).
            RewardFunctionError: a user function returned a wrong number of values (a programming error).
            RewardServerError: the scorer raised otherwise, or its process died (type and message are kept).
        """
        try:
            values, failures, hangs = self._box(prompts, completions, columns, completion_ids)
        except SandboxTimeout as err:
            hang = Hang("reward scorer", f"score of {len(completions)} completions", self.timeout_s, self.timeout_s,
                        "reward.server.timeout_s", ActorProcess("rlray-reward scorer", err.pid, ""), err.stacks,
                        "restart", "the scorer process was killed and restarted; the request fails (not retried)")
            log.error("rlray: %s", hang.message())
            raise RewardTimeoutError(
                f"scoring {len(completions)} completions took longer than reward.server.timeout_s="
                f"{self.timeout_s:g} s; the scorer process was restarted (a user reward function may hang); "
                f"{hang.message(ALERT_STACK_CHARS)}", hang) from None
        except SandboxError as err:
            if isinstance(err.original, RewardFunctionError):
                raise err.original from None
            raise RewardServerError(str(err)) from None
        except SandboxCrashed as err:
            raise RewardServerError(str(err)) from None
        for hang in hangs:  # in the replica's log; the run's client reports them too (ServeRewardClient.on_hang)
            log.error("rlray: %s", hang.message())
        return values, failures, hangs

    def close(self) -> None:
        """Waits for a call in progress, then stops the child process."""
        self._box.close()


class RewardService:
    """A versioned scorer sandbox that can be swapped while it serves.

    Args:
        version: reward version reported with every result.
        scorer_kwargs: keyword arguments of ``RewardScorer``.
        timeout_s: per-call timeout of the sandbox.
    """

    def __init__(self, version: int, scorer_kwargs: dict, timeout_s: float) -> None:
        self._current = (version, ScorerSandbox(scorer_kwargs, timeout_s))

    @property
    def version(self) -> int:
        """Returns the version that new calls are scored with."""
        return self._current[0]

    def score(self, prompts: list[str | list[dict]], completions: list[str], columns: list[dict[str, Any]],
              completion_ids: list[list[int]] | None = None) -> ScoreResult:  # fmt: skip
        """Returns the scores of one batch and the version that produced them (see ``ScorerSandbox.score``)."""
        version, sandbox = self._current
        values, failures, hangs = sandbox.score_with_reports(prompts, completions, columns, completion_ids)
        return ScoreResult(version, values, failures, hangs=hangs)

    def swap(self, version: int, scorer_kwargs: dict, timeout_s: float) -> None:
        """Builds a new sandbox, makes it current, then closes the old one after its call in progress.

        Raises:
            RewardServerError: the new scorer cannot be built; the old one stays current.
        """
        new = ScorerSandbox(scorer_kwargs, timeout_s)
        old = self._current[1]
        self._current = (version, new)
        old.close()

    def close(self) -> None:
        """Stops the sandbox process."""
        self._current[1].close()


# --------------------------------------------------------------------------------------------
# Serve application
# --------------------------------------------------------------------------------------------
@functools.cache
def _make_deployment():
    """Returns the Serve deployment class (built on first use, so importing this module needs no Serve)."""
    # deferred: Serve + FastAPI take seconds, and every scorer sandbox (spawned) imports this module
    from fastapi import FastAPI, HTTPException, Response
    from ray import serve

    api = FastAPI(title="rlray reward", docs_url=None, redoc_url=None)

    @serve.deployment(name="RewardScorer")
    @serve.ingress(api)
    class RewardDeployment:
        """Thin Serve wrapper over ``RewardService``: batching, hot swap, POST /score."""

        def __init__(self, max_batch_size: int, batch_wait_timeout_s: float) -> None:
            enable_stack_dumps()  # a request past the run's timeout is reported with this replica's stacks
            self.service: RewardService | None = None
            self._score_batch.set_max_batch_size(max_batch_size)
            self._score_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

        async def reconfigure(self, user_config: dict) -> None:
            """Builds (or hot-swaps to) the scorer of ``{"version", "scorer", "timeout_s"}``."""
            args = (int(user_config["version"]), dict(user_config["scorer"]), float(user_config["timeout_s"]))
            if self.service is None:
                self.service = await asyncio.to_thread(RewardService, *args)
            else:
                await asyncio.to_thread(self.service.swap, *args)

        async def score(self, request: dict) -> dict:
            """Returns ``{"version": v, "scores": {...}}`` for one request (the DeploymentHandle path)."""
            return await self._score_batch(ScoreRequest.model_validate(request))

        async def version(self) -> int:
            """Returns the reward version this replica serves."""
            return self.service.version

        @api.post("/score", response_model=ScoreReply)
        async def http_score(self, body: ScoreRequest) -> Any:
            """POST /score: JSON ScoreRequest in, ScoreReply out, NaN as "NaN" (errors: 504 timeout, 500 scorer failure)."""
            try:
                reply = ScoreReply.model_validate(await self._score_batch(body))
                return Response(reply.model_dump_json(), media_type="application/json")
            except RewardTimeoutError as err:
                raise HTTPException(status_code=504, detail=str(err)) from err
            except (RewardServerError, RewardFunctionError) as err:
                raise HTTPException(status_code=500, detail=str(err)) from err

        @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
        async def _score_batch(self, requests: list[ScoreRequest]) -> list[dict]:
            prompts = [x for r in requests for x in r.prompts]
            completions = [x for r in requests for x in r.completions]
            columns = [x for r in requests for x in r.columns]
            if all(r.completion_ids is not None for r in requests):
                completion_ids = [x for r in requests for x in r.completion_ids]
            else:  # a request without ids: the merged batch has none (a function that needs them gets None)
                completion_ids = None
            result = await asyncio.to_thread(self.service.score, prompts, completions, columns, completion_ids)
            out, start = [], 0
            for r in requests:
                end = start + len(r.completions)
                out.append({"version": result.version, "scores": {k: v[start:end] for k, v in result.values.items()},
                            "failures": result.failures[start:end], "hangs": result.hangs})
                start = end
            return out

        def __del__(self) -> None:
            if self.service is not None:
                self.service.close()

    return RewardDeployment


def build_reward_app(
    *,
    scorer_kwargs: dict,
    version: int,
    replicas: int = 1,
    cpus: float = 0.25,
    gpus: float = 0.0,
    custom_resources: dict[str, float] | None = None,
    max_batch_size: int = 32,
    batch_wait_timeout_s: float = 0.01,
    timeout_s: float = 60.0,
):
    """Returns the bound Serve application of the reward deployment, ready for ``serve.run``.

    Args:
        scorer_kwargs: keyword arguments of ``RewardScorer`` (they form the user_config, with version).
        version: reward version reported with every score.
        replicas: Serve replicas.
        cpus, gpus: Ray resources per replica.
        custom_resources: Ray custom resources per replica ({name: amount}; only nodes that offer them take one).
        max_batch_size: requests merged into one scorer call.
        batch_wait_timeout_s: seconds a partial batch waits.
        timeout_s: seconds one scorer call may take.
    """
    deployment = _make_deployment()
    return deployment.options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus, "num_gpus": gpus, "resources": dict(custom_resources or {})},
        user_config={"version": version, "scorer": scorer_kwargs, "timeout_s": timeout_s},
        max_ongoing_requests=max(4 * max_batch_size, 16),
    ).bind(max_batch_size, batch_wait_timeout_s)


def deploy_reward_app(app: Any, *, name: str = APP_NAME, host: str = "127.0.0.1", port: int = 8000) -> Any:
    """Starts Serve (HTTP on ``host:port``, once per cluster) and deploys ``app``; returns its DeploymentHandle.

    Deploying an application that already runs under ``name`` updates it in place: a changed
    user_config (a new reward version) is applied through ``reconfigure`` on the live replicas.
    """
    from ray import serve  # deferred: as in _make_deployment

    start_serve(host=host, port=port)
    return serve.run(app, name=name, route_prefix=f"/{name}" if name != APP_NAME else "/")


# What Serve's controller gives a new HTTP proxy actor to start (Serve's own default is 5 s): serve.start itself waits
# 60 s for the proxy (ray.serve._private.constants.HTTP_PROXY_TIMEOUT), so the controller is given as long.
PROXY_READY_CHECK_TIMEOUT_S = "60"


def start_serve(*, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Starts Ray Serve once per cluster, its HTTP proxy on ``host:port``; a later call connects to the running one.

    Serve's controller gives a new proxy actor ``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S`` seconds (5 by default) to
    start. On a loaded 2-core machine the proxy's worker process and its imports took longer: the controller killed it
    to start another, and ``serve.start`` failed with ``ActorDiedError`` ("killed by ray.kill ... cancelled before it
    started running"; seen on CI). The controller is started with ``PROXY_READY_CHECK_TIMEOUT_S`` unless this process's
    environment sets the variable (``controller_options``, Ray Serve's ``ControllerOptions``).

    A proxy still not ready after ``serve.start``'s own 60 s (seen with four test suites on 2 cores) is not an error:
    the run calls its applications through handles, which need no proxy, so this logs a warning and connects to the
    running controller; HTTP on ``host:port`` answers once the proxy is up.
    """
    from ray import serve  # deferred: as in _make_deployment

    ready_s = os.environ.get("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", PROXY_READY_CHECK_TIMEOUT_S)
    http = {"host": host, "port": port}
    try:
        serve.start(http_options=http,
                    controller_options={"runtime_env": {"env_vars": {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": ready_s}}})
    except TimeoutError as err:  # Serve's words: "HTTP proxies not available after 60s."
        log.warning("rlray: Ray Serve's HTTP proxy is not up yet (%s); going on through handles, HTTP on %s:%d "
                    "answers once it starts", err, host, port)
        serve.start(http_options=http)  # the controller is running: this connects to it, without waiting for proxies


# --------------------------------------------------------------------------------------------
# Clients (what a run calls)
# --------------------------------------------------------------------------------------------
class LocalRewardClient:
    """Scores in this process with a ``RewardScorer`` (no server; user functions still run in their sandboxes).

    Args:
        scorer: the scorer.
        version: reward version reported with every result.
    """

    def __init__(self, scorer: Any, version: int) -> None:
        self.scorer = scorer
        self.version = version

    def score(self, prompts: list[str | list[dict]], completions: list[str], columns: list[dict[str, Any]],
              completion_ids: list[list[int]] | None = None) -> ScoreResult:  # fmt: skip
        """Returns the scorer's values (NaN failed, None skipped), why each failed sample failed, and this client's
        version."""
        return ScoreResult(self.version, *self.scorer.score_with_failures(prompts, completions, columns, completion_ids))

    def close(self) -> None:
        """Stops the scorer's user-function processes."""
        self.scorer.close()


# Answers of a live server: retrying the same batch cannot change them.
_ANSWERS = (RewardFunctionError, RewardServerError, RewardTimeoutError, ValueError)


def _unreachable(err: BaseException) -> bool:
    """Returns True for errors that mean the server did not answer (a dead or restarting replica, a timeout)."""
    import ray.exceptions  # deferred: as in _make_deployment
    from ray.serve.exceptions import RayServeException

    if isinstance(err, _ANSWERS):
        return False
    return isinstance(err, (ray.exceptions.RayActorError, RayServeException, TimeoutError, ConnectionError))


class ServeRewardClient:
    """Scores through the Serve application's DeploymentHandle, retrying while the server does not answer.

    A request that fails because no replica answers (a killed replica that Serve restarts, an application
    being redeployed, a request past ``timeout_s``) is sent again after an exponential back-off (tenacity:
    ``backoff_s``, doubling, at most 30 s); after ``attempts`` tries, ``RewardServerUnavailableError``.

    Args:
        app_name: the Serve application name (``reward.server.app_name``).
        attempts: tries per request (``reward.server.client_attempts``).
        timeout_s: seconds one try may take, queueing for a replica included (``reward.server.client_timeout_s``).
        backoff_s: the first wait between tries, in seconds.
        handle: the DeploymentHandle to use (tests); None looks the application up.
        on_timeout: called with (the call, seconds waited) when a try gets no reply within ``timeout_s``, before the
            next try: the run's hang report (``rlray.hangs.HangWatch.timed_out``: the replicas' stacks, an alert); it
            may raise to stop the run (``HangError``, not retried). None: the retry's warning only.
        on_hang: called with the report of a process killed at its own timeout for a request (the scorer's, then
            ``RewardTimeoutError``; a user function's, in the reply): ``HangWatch.killed``, which may raise. None: the
            replica's log line only.

    Raises:
        RewardServerUnavailableError: the application cannot be found after every try.
    """

    def __init__(self, app_name: str = APP_NAME, *, attempts: int = 5, timeout_s: float = 300.0,
                 backoff_s: float = 1.0, handle: Any = None,
                 on_timeout: Callable[[str, float], object] | None = None,
                 on_hang: Callable[[Hang], object] | None = None) -> None:
        self.app_name, self.attempts, self.timeout_s, self.backoff_s = app_name, attempts, timeout_s, backoff_s
        self.on_timeout, self.on_hang = on_timeout, on_hang
        if handle is None:
            from ray import serve  # deferred: as in _make_deployment

            handle = self._retrying(lambda: serve.get_app_handle(app_name), "find the application")
        self.handle = handle

    def score(self, prompts: list[str | list[dict]], completions: list[str], columns: list[dict[str, Any]],
              completion_ids: list[list[int]] | None = None) -> ScoreResult:  # fmt: skip
        """Returns the server's scores (NaN failed, None skipped) and the version that produced them.

        Arguments as in ``RewardScorer.score``; they travel to the replica pickled (no JSON, so NaN stays NaN).

        Raises:
            RewardTimeoutError, RewardServerError, RewardFunctionError: raised by the server for this request.
            RewardServerUnavailableError: no answer after ``attempts`` tries.
        """
        body = {"prompts": prompts, "completions": completions, "columns": columns, "completion_ids": completion_ids}
        try:
            reply = self._retrying(lambda: self._try(body), "score")
        except RewardTimeoutError as err:  # the scorer process was killed at reward.server.timeout_s
            if self.on_hang is not None and err.hang is not None:
                self.on_hang(err.hang)
            raise
        reply = ScoreReply.model_validate(reply)  # "NaN" strings, should a reply come through JSON, become NaN
        for hang in reply.hangs if self.on_hang is not None else ():
            self.on_hang(hang)
        return ScoreResult(reply.version, reply.scores, reply.failures, hangs=reply.hangs)

    def _try(self, body: dict[str, Any]) -> Any:
        """Returns one try's reply to ``body``; a try past ``timeout_s`` is reported (``on_timeout``) and re-raised."""
        t0 = time.monotonic()
        try:
            return self.handle.score.remote(body).result(timeout_s=self.timeout_s)
        except TimeoutError:
            if self.on_timeout is not None:
                self.on_timeout("score", time.monotonic() - t0)
            raise

    def close(self) -> None:
        """Does nothing: the application outlives its clients."""

    def _retrying(self, call: Any, what: str) -> Any:
        """Returns ``call()``, retried with back-off while the server does not answer."""
        t0 = time.monotonic()

        def before_sleep(state: Any) -> None:
            log.warning("reward server '%s': %s failed (try %d of %d: %s); retrying", self.app_name, what,
                        state.attempt_number, self.attempts, state.outcome.exception())

        retrying = Retrying(
            stop=stop_after_attempt(self.attempts), wait=wait_exponential(multiplier=self.backoff_s, max=30.0),
            retry=retry_if_exception(_unreachable), before_sleep=before_sleep,
        )  # fmt: skip
        try:
            return retrying(call)
        except RetryError as err:
            last = err.last_attempt.exception()
            raise RewardServerUnavailableError(
                f"the reward server (Serve application '{self.app_name}') did not answer: {what} failed {self.attempts} "
                f"times over {time.monotonic() - t0:.0f} s, last with {type(last).__name__}: {last}; check "
                "`serve status` and reward.server.*, or raise reward.server.client_attempts"
            ) from last
