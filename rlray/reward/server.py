"""The reward server: the Serve application ``rlray-reward`` and the clients the loop scores through.

Layers, bottom up:
- ``ScorerSandbox``: a child process that holds one ``RewardScorer`` (rules, user functions, and the
  reward model when the scorer has one). A call that runs past ``timeout_s`` kills the process,
  starts a fresh one and fails with ``RewardTimeoutError``, so a hung user function never wedges a
  replica (Python threads cannot be killed; processes can).
- ``RewardService``: a plain class with a version number and a sandbox. ``swap`` builds the new
  sandbox first and only then replaces the old one, so calls keep being served during a swap.
- ``RewardDeployment``: the thin Serve deployment. ``@serve.batch`` merges concurrent requests into
  one scorer call; ``reconfigure`` (Serve's user_config) hot-swaps the scorer and its version;
  FastAPI serves ``POST /score``.
- ``LocalRewardClient`` / ``ServeRewardClient``: what the loop calls, ``score(...) -> ScoreResult``.

Hot swap: deploying the application again with a new user_config (``{"version": v, "scorer": kwargs}``,
e.g. a new reward-model path in the kwargs) makes Serve call ``reconfigure`` on the running replicas
in place; requests are never dropped (see tests/reward/test_server.py).

The scorer is built as ``RewardScorer(**scorer_kwargs)``; any argument the scorer accepts (a reward
model path, say) travels through the kwargs unchanged.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import threading
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field, model_validator

APP_NAME = "rlray-reward"
_START_TIMEOUT_S = 300.0  # loading a reward model can take minutes


class RewardTimeoutError(TimeoutError):
    """A scorer call ran past its timeout; the sandbox was restarted. Names the timeout."""


class RewardServerError(RuntimeError):
    """The scorer failed inside the sandbox (a bad user function, a model that cannot load)."""


@dataclass(frozen=True)
class ScoreResult:
    """Scores of a batch of completions and the reward version that produced them.

    Attributes:
        version: reward version (``reward.version`` of the deployed config).
        values: {"reward": [...], "accuracy": [...], "format": [...], <user terms>: [...]}, B each.
    """

    version: int
    values: dict[str, list[float]]


class ScoreRequest(BaseModel):
    """One scoring request: B prompts, completions and reference answers (the JSON body of POST /score)."""

    prompts: list[str]
    completions: list[str]
    references: list[str]

    @model_validator(mode="after")
    def _same_length(self) -> "ScoreRequest":
        n = len(self.completions)
        if len(self.prompts) != n or len(self.references) != n:
            raise ValueError(
                f"prompts ({len(self.prompts)}), completions ({n}) and references ({len(self.references)}) "
                "must have the same length"
            )
        return self


class ScoreReply(BaseModel):
    """The JSON reply of POST /score."""

    version: int = Field(description="reward version that scored the request")
    scores: dict[str, list[float]] = Field(description="reward terms, one value per completion")


# --------------------------------------------------------------------------------------------
# Sandbox process
# --------------------------------------------------------------------------------------------
def _sandbox_main(conn: Any, scorer_kwargs: dict) -> None:
    """Child process: builds the scorer, then answers (prompts, completions, references) until None."""
    try:
        from rlray.reward.scorer import RewardScorer

        scorer = RewardScorer(**scorer_kwargs)
    except Exception as err:  # reported to the parent, which raises it with the message
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        try:
            conn.send(("ok", scorer.score(*msg)))
        except Exception as err:
            conn.send(("error", f"{type(err).__name__}: {err}"))


class ScorerSandbox:
    """A ``RewardScorer`` in a child process, called one batch at a time with a timeout.

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
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_sandbox_main, args=(child, self.scorer_kwargs), daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(_START_TIMEOUT_S):
            self._kill()
            raise RewardTimeoutError(f"the reward scorer did not start within {_START_TIMEOUT_S:.0f} s")
        status, detail = self._conn.recv()
        if status != "ready":
            self._kill()
            raise RewardServerError(f"the reward scorer could not be built: {detail}")

    def score(self, prompts: list[str], completions: list[str], references: list[str]) -> dict[str, list[float]]:
        """Returns the scorer's {term: [B values]} for one batch (thread-safe; calls run one at a time).

        Raises:
            RewardTimeoutError: the call ran past ``timeout_s`` (the child is killed and restarted).
            RewardServerError: the scorer raised (its type and message are kept).
        """
        with self._lock:
            self._conn.send((prompts, completions, references))
            if not self._conn.poll(self.timeout_s):
                self._kill()
                self._start()
                raise RewardTimeoutError(
                    f"scoring {len(completions)} completions took longer than reward.server.timeout_s="
                    f"{self.timeout_s:g} s; the scorer process was restarted (a user reward function may hang)"
                )
            status, value = self._conn.recv()
        if status != "ok":
            raise RewardServerError(value)
        return value

    def close(self) -> None:
        """Waits for a call in progress, then stops the child process."""
        with self._lock:
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=5)
            self._kill()

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._conn.close()


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

    def score(self, prompts: list[str], completions: list[str], references: list[str]) -> ScoreResult:
        """Returns the scores of one batch and the version that produced them (see ``ScorerSandbox.score``)."""
        version, sandbox = self._current
        return ScoreResult(version, sandbox.score(prompts, completions, references))

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
    from fastapi import FastAPI, HTTPException
    from ray import serve

    api = FastAPI(title="rlray reward", docs_url=None, redoc_url=None)

    @serve.deployment(name="RewardScorer")
    @serve.ingress(api)
    class RewardDeployment:
        """Thin Serve wrapper over ``RewardService``: batching, hot swap, POST /score."""

        def __init__(self, max_batch_size: int, batch_wait_timeout_s: float) -> None:
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
        async def http_score(self, body: ScoreRequest) -> dict:
            """POST /score: JSON ScoreRequest in, ScoreReply out (errors: 504 timeout, 500 scorer failure)."""
            try:
                return await self._score_batch(body)
            except RewardTimeoutError as err:
                raise HTTPException(status_code=504, detail=str(err)) from err
            except RewardServerError as err:
                raise HTTPException(status_code=500, detail=str(err)) from err

        @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
        async def _score_batch(self, requests: list[ScoreRequest]) -> list[dict]:
            prompts = [x for r in requests for x in r.prompts]
            completions = [x for r in requests for x in r.completions]
            references = [x for r in requests for x in r.references]
            result = await asyncio.to_thread(self.service.score, prompts, completions, references)
            out, start = [], 0
            for r in requests:
                end = start + len(r.completions)
                out.append({"version": result.version, "scores": {k: v[start:end] for k, v in result.values.items()}})
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
        max_batch_size: requests merged into one scorer call.
        batch_wait_timeout_s: seconds a partial batch waits.
        timeout_s: seconds one scorer call may take.
    """
    deployment = _make_deployment()
    return deployment.options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus, "num_gpus": gpus},
        user_config={"version": version, "scorer": scorer_kwargs, "timeout_s": timeout_s},
        max_ongoing_requests=max(4 * max_batch_size, 16),
    ).bind(max_batch_size, batch_wait_timeout_s)


def deploy_reward_app(app: Any, *, name: str = APP_NAME, host: str = "127.0.0.1", port: int = 8000) -> Any:
    """Starts Serve (HTTP on ``host:port``, once per cluster) and deploys ``app``; returns its DeploymentHandle.

    Deploying an application that already runs under ``name`` updates it in place: a changed
    user_config (a new reward version) is applied through ``reconfigure`` on the live replicas.
    """
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    return serve.run(app, name=name, route_prefix=f"/{name}" if name != APP_NAME else "/")


# --------------------------------------------------------------------------------------------
# Clients (what the loop calls)
# --------------------------------------------------------------------------------------------
class LocalRewardClient:
    """Scores in this process with a ``RewardScorer`` (no server).

    Args:
        scorer: the scorer.
        version: reward version reported with every result.
    """

    def __init__(self, scorer: Any, version: int) -> None:
        self.scorer = scorer
        self.version = version

    def score(self, prompts: list[str], completions: list[str], references: list[str]) -> ScoreResult:
        """Returns the scorer's values and this client's version."""
        return ScoreResult(self.version, self.scorer.score(prompts, completions, references))


class ServeRewardClient:
    """Scores through the Serve application's DeploymentHandle.

    Args:
        app_name: the Serve application name (``reward.server.app_name``).
    """

    def __init__(self, app_name: str = APP_NAME) -> None:
        from ray import serve

        self.handle = serve.get_app_handle(app_name)

    def score(self, prompts: list[str], completions: list[str], references: list[str]) -> ScoreResult:
        """Returns the server's scores and the version that produced them.

        Raises:
            RewardTimeoutError, RewardServerError: raised by the server for this request.
        """
        reply = self.handle.score.remote({"prompts": prompts, "completions": completions, "references": references}).result()
        return ScoreResult(int(reply["version"]), reply["scores"])
