"""A judge on Ray Serve: one application per judge (``rlray-judge-<name>``), its replicas each holding a
``JudgeService``, and the caller the run's judge client talks to.

- ``JudgeDeployment``: the thin Serve deployment. ``reconfigure`` (Serve's user_config ``{"version", "spec"}``)
  builds the judge (and, should Serve reconfigure a live replica, swaps it: the old engine stops, then the new one
  starts, one vLLM engine per process, requests waiting). ``judge`` answers one chunk at a time (the engine is not
  thread-safe), ``identity`` says which version and definition answer, without waiting for calls.
- ``build_judge_app`` / ``deploy_judge_app``: the bound application and ``serve.run``. Deploying it again with a new
  user_config (a new ``reward.version``, a new judge path or template) is the hot swap, as for the reward
  application: Serve replaces the replicas by ones built from the new user_config (measured here: a new replica
  process each; ``serve.run`` gives every deployment a new code version), and requests wait in the handle's queue
  meanwhile; none is dropped (tests/reward/test_judges_serve.py).
- ``ServeJudgeCaller``: what ``rlray.reward.judges.client.JudgeClient`` calls: one request per chunk, through the
  application's DeploymentHandle, waited for at most ``timeout_s`` (then cancelled).

Replicas: Serve spreads concurrent requests over them, so the client sends a step's judgements as one chunk per
replica, all at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any

from rlray.hangs import enable_stack_dumps
from rlray.reward.judges.records import JudgeReply, JudgeRequest, JudgeSpec
from rlray.reward.judges.service import JudgeService

DEPLOYMENT = "Judge"  # the deployment's name inside each judge application


@functools.cache
def _make_deployment():
    """Returns the Serve deployment class (built on first use, so importing this module needs no Serve)."""
    from ray import serve  # deferred: Serve's import takes seconds

    @serve.deployment(name=DEPLOYMENT)
    class JudgeDeployment:
        """Thin Serve wrapper over ``JudgeService``: one chunk at a time, hot swap by ``reconfigure``."""

        def __init__(self) -> None:
            enable_stack_dumps()  # a chunk past the run's timeout is reported with this replica's stacks
            self.service: JudgeService | None = None
            self._lock = asyncio.Lock()

        async def reconfigure(self, user_config: dict) -> None:
            """Builds (or swaps to) the judge of ``{"version", "spec"}``: the old engine stops, then the new one starts."""
            spec, version = JudgeSpec.from_dict(dict(user_config["spec"])), int(user_config["version"])
            async with self._lock:
                old, self.service = self.service, None
                if old is not None:
                    await asyncio.to_thread(old.close)
                self.service = await asyncio.to_thread(JudgeService, spec, version)

        async def identity(self) -> tuple[int, str]:
            """Returns (version, definition hash) of the judge this replica serves, without waiting for its calls.

            Raises:
                RuntimeError: the judge is being built (a swap in progress).
            """
            service = self.service
            if service is None:
                raise RuntimeError("the judge is starting (a swap in progress)")
            return service.version, service.spec.definition

        async def judge(self, request: JudgeRequest) -> JudgeReply:
            """Returns the verdicts of one chunk (``JudgeService.judge``)."""
            async with self._lock:
                return await asyncio.to_thread(self.service.judge, request)

        def __del__(self) -> None:
            if self.service is not None:
                self.service.close()

    return JudgeDeployment


def build_judge_app(spec: JudgeSpec, version: int, *, replicas: int = 1, cpus: float = 0.25, gpus: float = 0.0,
                    custom_resources: dict[str, float] | None = None) -> Any:  # fmt: skip
    """Returns the bound Serve application of one judge, ready for ``deploy_judge_app``.

    Args:
        spec: the judge's definition (with ``version``, the user_config: changing either hot-swaps the judge).
        version: the judge's version (``reward.version``).
        replicas: Serve replicas, each with its own engine.
        cpus, gpus, custom_resources: Ray resources per replica.
    """
    return _make_deployment().options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus, "num_gpus": gpus, "resources": dict(custom_resources or {})},
        user_config={"version": version, "spec": dataclasses.asdict(spec)},
        max_ongoing_requests=8,
        health_check_timeout_s=600.0,  # a swap holds the replica's lock while an engine starts
    ).bind()


def deploy_judge_app(app: Any, name: str, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Starts Serve (its HTTP proxy on ``host:port``, as the reward application's, once per cluster) and deploys the
    judge application ``name`` (no HTTP route: the run calls it through its handle); blocks until it serves.

    Deploying an application that already runs under ``name`` updates it: the hot swap (module docstring).
    """
    from ray import serve  # deferred: as in _make_deployment

    from rlray.reward.server import start_serve

    start_serve(host=host, port=port)
    serve.run(app, name=name, route_prefix=None)


class ServeJudgeCaller:
    """Calls one judge application through its DeploymentHandle (found on first use, again after a failure).

    Args:
        app_name: the Serve application (``reward.judges[i].app_name``: ``rlray-judge-<name>``).
    """

    def __init__(self, app_name: str) -> None:
        self.app_name = app_name
        self._handle: Any = None

    def _handle_now(self) -> Any:
        if self._handle is None:
            from ray import serve  # deferred: as in _make_deployment

            self._handle = serve.get_app_handle(self.app_name)
        return self._handle

    def identity(self, timeout_s: float) -> tuple[int, str]:
        """Returns (version, definition) of a replica of the judge.

        Raises:
            TimeoutError: no answer within ``timeout_s``; Serve's and Ray's errors when the application is down.
        """
        return tuple(self._call(lambda h: h.identity.remote(), timeout_s))

    def judge(self, request: JudgeRequest, timeout_s: float) -> JudgeReply:
        """Returns a replica's reply to ``request``.

        Raises:
            TimeoutError: no reply within ``timeout_s`` (the request is cancelled); Serve's and Ray's errors when
                the application is down.
        """
        return self._call(lambda h: h.judge.remote(request), timeout_s)

    def _call(self, send: Any, timeout_s: float) -> Any:
        try:
            response = send(self._handle_now())
        except Exception:
            self._handle = None  # look the application up again next time (it may have been redeployed)
            raise
        try:
            return response.result(timeout_s=timeout_s)
        except TimeoutError:
            response.cancel()
            raise
        except Exception:
            self._handle = None
            raise
