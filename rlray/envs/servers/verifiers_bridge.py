"""The verifiers bridge: a small HTTP server, run inside verifiers' own Python environment, that plays whole episodes.

verifiers 0.4 (``verifiers.v1``) pins ``openai<3`` and ``mcp==2.0.0``, so it cannot share rlray's Python environment.
This script runs in ``.venvs/verifiers`` (``make verifiers-venv``) as a separate process, the way prime-rl runs each
environment as its own server; it imports only the standard library, ``aiohttp`` and verifiers (all in that venv),
never rlray. It loads the environment by its config (``{"taskset": {"id": "<module>"}, ...}``, verifiers'
``EnvConfig``; the taskset is a module on ``sys.path`` or ``--path``, as ``vf-eval`` loads it) and plays each
requested task through verifiers' own episode runner, ``Env.run_slot``, exactly as verifiers' env server
(``verifiers.v1.serve.server.EnvServer._run``) does: the environment's harness calls the model at the
OpenAI-compatible ``base_url`` it is given (rlray's gateway, which records every sampled token), then the task's
``@vf.reward`` functions score the trace. rlray's side is ``rlray.envs.servers.verifiers`` (an agent that posts one
request per episode). verifiers' own ZMQ server is not used because its client (trace deltas, msgpack) would need
verifiers on rlray's side.

Routes (JSON, bound to 127.0.0.1 unless ``--host`` says otherwise):
- ``GET /health``: ``{"ok": true, "taskset": id, "verifiers": version, "tasks": N}``.
- ``GET /tasks``: the taskset's tasks (``TaskData`` dumps), in ``load()`` order.
- ``POST /rollout``: ``{"task_index": i | "task": {...TaskData}, "base_url", "model", "api_key", "sampling": {...}}``
  gives ``summarize(episode)``: ``{"reward", "scores", "weights", "metrics", "ok", "errors", "turns"}``.

rlray runs it as an environment server (``rlray.envs.servers.verifiers.bridge_spec``: a ``ServerSpec`` that the
supervisor starts with ``--host {host} --port {port}``, restarts and stops; it is ready when ``GET /health`` answers).
By hand: ``.venvs/verifiers/bin/python rlray/envs/servers/verifiers_bridge.py --env '{"taskset": {"id": "vf_sum"}}'
--path tests/envs/verifiers --port 0`` prints ``rlray-verifiers-bridge listening on http://127.0.0.1:<port>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from typing import Any

READY_LINE = "rlray-verifiers-bridge listening on"  # printed once listening (its log; the port when --port 0)


def summarize(episode: Any) -> dict[str, Any]:
    """Returns one verifiers episode's rewards as plain JSON.

    The episode's reward is verifiers' own: ``Trace.reward``, the weighted sum ``sum(score * weight)`` of the
    task's ``@vf.reward`` functions, over its traces (a single-agent episode has one; a multi-agent episode's
    traces' rewards are averaged, as are their per-function scores). A function whose scoring did not run
    (``None`` in ``Trace.rewards``) is left out of ``scores``; an episode with no scored trace has reward None.

    Args:
        episode: a ``verifiers.v1.Episode`` (``Env.run_slot``'s result).

    Returns:
        ``{"reward": float | None, "scores": {name: mean unweighted score}, "weights": {name: weight},
        "metrics": {name: mean}, "ok": bool, "errors": [str], "turns": int}``.
    """
    traces = list(episode.traces)
    scores: dict[str, list[float]] = {}
    weights: dict[str, float] = {}
    metrics: dict[str, list[float]] = {}
    for trace in traces:
        for name, reward in trace.rewards.items():
            if reward is not None and math.isfinite(reward.score):
                scores.setdefault(name, []).append(float(reward.score))
                weights[name] = float(reward.weight)
        for name, value in trace.metrics.items():
            if value is not None:
                metrics.setdefault(name, []).append(float(value))
    scored = [t for t in traces if any(r is not None for r in t.rewards.values())]
    errors = [f"{e.type}: {e.message}" for e in [*episode.errors, *(e for t in traces for e in t.errors)]]
    return {
        "reward": sum(float(t.reward) for t in scored) / len(scored) if scored else None,
        "scores": {k: sum(v) / len(v) for k, v in scores.items()},
        "weights": weights,
        "metrics": {k: sum(v) / len(v) for k, v in metrics.items()},
        "ok": bool(episode.ok),
        "errors": errors,
        "turns": int(episode.num_turns),
    }


class Bridge:
    """The loaded environment and the episodes it plays (one asyncio loop; ``max_concurrent`` bounds episodes).

    Args:
        env_config: verifiers' ``EnvConfig`` data (the single-agent seat's runtime defaults to ``subprocess``, a
            local process, where verifiers' own default is Prime's hosted sandbox), e.g. ``{"taskset": {"id": "vf_sum"}, "agent": {"harness": {"id":
            "null"}}}``.
        max_concurrent: episodes played at once (None: unbounded).

    Raises:
        ModuleNotFoundError, ValueError: verifiers' own errors for a taskset that does not load.
    """

    def __init__(self, env_config: dict[str, Any], max_concurrent: int | None = None) -> None:
        import verifiers
        import verifiers.v1 as vf

        self.vf = vf
        self.version = verifiers.__version__
        env_config = json.loads(json.dumps(env_config))  # a copy
        agent = env_config.setdefault("agent", {})
        if isinstance(agent, dict):  # the single-agent env's seat: a local process, not Prime's hosted sandbox
            agent.setdefault("runtime", {"type": "subprocess"})
        self.config = vf.resolve_env_config(env_config)
        self.env = vf.load_environment(self.config)
        self.tasks = list(self.env.taskset)
        task_cls = type(self.env.taskset).task_type()
        self._task_cls, self._data_cls = task_cls, task_cls.data_type()
        self._gate = asyncio.Semaphore(max_concurrent) if max_concurrent else None

    def task(self, request: dict[str, Any]) -> Any:
        """Returns the request's task: ``task_index`` into ``load()``'s tasks, or ``task`` (a ``TaskData`` dump).

        Raises:
            ValueError: neither key, or an index out of range (the message names it).
        """
        if "task" in request:
            return self._task_cls(self._data_cls.model_validate(request["task"]), self.env.config.taskset.task)
        if "task_index" not in request:
            raise ValueError("rlray: a verifiers rollout needs 'task_index' or 'task'")
        i = int(request["task_index"])
        if not 0 <= i < len(self.tasks):
            raise ValueError(f"rlray: task_index {i} is outside the taskset's {len(self.tasks)} tasks")
        return self.tasks[i]

    async def rollout(self, request: dict[str, Any]) -> dict[str, Any]:
        """Plays one episode against ``request["base_url"]`` and returns ``summarize`` of it."""
        vf = self.vf
        os.environ["RLRAY_BRIDGE_API_KEY"] = str(request.get("api_key") or "EMPTY")
        client = vf.EvalClientConfig(base_url=request["base_url"], api_key_var="RLRAY_BRIDGE_API_KEY")
        ctx = vf.ModelContext(model=str(request.get("model") or "policy"), client=client,
                              sampling=vf.SamplingConfig.model_validate(request.get("sampling") or {}))
        (slot,) = self.env.slots(self.task(request))
        episode = await self.env.run_slot(slot, ctx, self._gate)
        return summarize(episode)


async def serve(bridge: Bridge, host: str, port: int) -> None:
    """Serves ``bridge`` over HTTP until cancelled; prints ``READY_LINE`` and the URL once listening."""
    from aiohttp import web

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, "taskset": bridge.config.taskset.id, "verifiers": bridge.version,
                                  "tasks": len(bridge.tasks)})

    async def tasks(_: web.Request) -> web.Response:
        return web.json_response([t.data.model_dump(mode="json") for t in bridge.tasks])

    async def rollout(request: web.Request) -> web.Response:
        try:
            return web.json_response(await bridge.rollout(await request.json()))
        except Exception as err:  # a failed episode is an answer, not a dead server
            return web.json_response({"error": f"{type(err).__name__}: {err}"}, status=500)

    app = web.Application(client_max_size=64 * 2**20)
    app.add_routes([web.get("/health", health), web.get("/tasks", tasks), web.post("/rollout", rollout)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    async with bridge.env.serving():
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # port 0: the port the OS gave
        print(f"{READY_LINE} http://{host}:{bound}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    """Parses the command line (``--env JSON``, ``--path DIR`` (repeatable), ``--host``, ``--port``,
    ``--max-concurrent``) and serves until killed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help="verifiers EnvConfig as JSON, e.g. '{\"taskset\": {\"id\": \"x\"}}'")
    parser.add_argument("--path", action="append", default=[], help="a folder to put on sys.path (the taskset's)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-concurrent", type=int, default=None)
    args = parser.parse_args(argv)
    # This script's folder (first on sys.path) holds rlray's `verifiers.py`, which would shadow the package.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.abspath(p) for p in args.path] + [p for p in sys.path if os.path.abspath(p or ".") != here]
    # The harness's chat program is a PEP 723 script that verifiers runs with `uv`: the venv's own `uv` first.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    bridge = Bridge(json.loads(args.env), args.max_concurrent)
    asyncio.run(serve(bridge, args.host, args.port))


if __name__ == "__main__":
    main()
