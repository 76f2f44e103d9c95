"""No silent hang: the Python stacks of a stuck process, and what the run does about a remote call past its deadline.

Every remote call the run waits on has a deadline (``watchdog.*``, ``rlray.plan.Deadlines``). The waiter (the rollout
fleet for engine calls and weight pushes, the episode loop for environment hosts, each learner rank for its calls to
the reference and teacher actors: ``rlray.run.frozen_calls``) hands a call past its deadline to ``HangWatch.hung``,
which

1. takes the stuck process's Python stacks, every thread's, from the process itself: each rlray actor calls
   ``enable_stack_dumps`` when it starts, which registers ``faulthandler`` on ``STACK_SIGNAL`` (SIGUSR2) with a file of
   its own; ``actor_stacks`` finds the actor's pid and node in Ray's GCS, sends the signal (from this process when the
   actor runs on this node, else from a zero-CPU Ray task placed on its node) and reads what the handler wrote.
   faulthandler writes from a C signal handler without taking the GIL, and the actor's methods keep running on its
   main thread (a Ray concurrency group for a stack method would move them to a pool thread: vLLM's and torch's
   thread setup belongs to the thread that built the engine);
2. logs an ``rlray: hang`` error line and sends the ``hang`` alert (through the run's alert path: the monitor, MLflow
   tag ``rlray.alert.hang``, the webhook; the driver's console prints it) naming the actor, its pid, the call, how
   long it ran, the deadline's key and the stacks;
3. applies ``watchdog.on_hang``: "restart" kills the actor's process so that Ray restarts it (up to its
   ``max_restarts``) and the waiter's usual fault path runs its work again (counted by the waiter:
   ``rollout/rerun_prompts``, ``env/episodes_rerun``; a reference or teacher call is made once more); "stop" raises
   ``HangError``, which ends the run (a fatal step error: every rank stops, status FAILED, the message in MLflow's
   ``rlray.error``) after a snapshot of the last finished step.

A request to a Serve application (the reward server, a judge) keeps its client's own timeout
(``reward.server.client_timeout_s``, ``reward.judges[i].timeout_s``): each try past it goes to ``HangWatch.timed_out``,
which reports it with the stacks of every live replica of the application (``serve_stacks``: the replicas call
``enable_stack_dumps`` when they start) and leaves the action to the client's retries, except under "stop".

A call whose own time limit kills its process (a user reward function's sandbox at ``reward.functions[i].timeout_s``,
the reward server's scorer process at ``reward.server.timeout_s``: ``rlray.sandbox`` takes the child's stacks before
the kill and starts a fresh child) goes to ``HangWatch.killed``: the same report, then "stop" raises ``HangError``.

The learner ranks' collectives have a coarser deadline: ``StepDeadline`` times each step of a rank from a timer
thread and reports a step past ``watchdog.learner_step_s`` with the rank's own stacks (``own_stacks``). A rank's own
hang cannot be cured in place (a rank stuck in a collective cannot even take a snapshot): its ``HangAction`` exits the
rank, and Ray Train restarts the group from the newest snapshot, or under "stop" the run ends FAILED there.

Python cannot kill a thread, so a hung call is never "cancelled" in place: the process that runs it is restarted.
This module imports only the standard library at import time (Ray where a function needs it).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import math
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)

STACK_SIGNAL = signal.SIGUSR2
"""The signal on which an rlray process writes its threads' stacks (``enable_stack_dumps``); Ray uses none of
SIGUSR1/SIGUSR2. A process that did not register it is never sent it (its default action ends the process)."""
HANG_ACTIONS = ("restart", "stop")
ALERT_STACK_CHARS = 4000  # an alert keeps this many characters of the stacks (MLflow tags hold 5000); the log, all
_STACK_FILE: TextIO | None = None  # the open file of this process's registration (kept open for the C handler)


def stack_file(pid: int) -> Path:
    """Returns the file process ``pid`` writes its stacks to: ``<tmp>/rlray-stacks/<pid>.txt`` on its own node."""
    return Path(tempfile.gettempdir()) / "rlray-stacks" / f"{pid}.txt"


def enable_stack_dumps() -> Path:
    """Makes this process write every thread's Python stack to ``stack_file(os.getpid())`` on ``STACK_SIGNAL``
    (``faulthandler.register``, appending); returns that file. Idempotent; called by each rlray actor when it starts.
    """
    global _STACK_FILE
    path = stack_file(os.getpid())
    if _STACK_FILE is None or _STACK_FILE.closed or Path(_STACK_FILE.name) != path:  # a forked child has its own pid
        path.parent.mkdir(parents=True, exist_ok=True)
        _STACK_FILE = open(path, "a")  # noqa: SIM115 - kept open for the life of the process (the handler's fd)
        faulthandler.register(STACK_SIGNAL, file=_STACK_FILE, all_threads=True, chain=False)
    return path


def catches_stack_signal(pid: int) -> bool:
    """Returns True when process ``pid`` (on this node) handles ``STACK_SIGNAL`` and has its stack file: Linux reads
    the caught-signal mask in ``/proc/<pid>/status``; elsewhere the file alone decides."""
    if not stack_file(pid).exists():
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return os.name == "posix" and not Path("/proc/self/status").exists()  # no procfs (macOS): trust the file
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (int(STACK_SIGNAL) - 1) & 1)


def dump_stacks(pid: int, timeout_s: float = 5.0) -> str:
    """Returns the Python stacks of every thread of process ``pid`` on this node, as faulthandler writes them
    ("Thread 0x... (most recent call first):" then '  File "f.py", line N in name' per frame), or a line in
    parentheses saying why there are none (the process did not ``enable_stack_dumps``, is gone, or wrote nothing
    within ``timeout_s`` seconds)."""
    path = stack_file(pid)
    if not catches_stack_signal(pid):
        return f"(no stacks: process {pid} does not write them on {STACK_SIGNAL.name}; not an rlray actor, or gone)"
    start = path.stat().st_size
    try:
        os.kill(pid, STACK_SIGNAL)
    except ProcessLookupError:
        return f"(no stacks: process {pid} is gone)"
    deadline, last = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        time.sleep(0.1)
        size = path.stat().st_size
        if size > start and size == last:  # written, and not growing any more
            break
        last = size
    with open(path) as f:
        f.seek(start)
        text = f.read()
    return text or f"(no stacks: process {pid} wrote nothing within {timeout_s:g} s)"


@dataclass(frozen=True)
class ActorProcess:
    """Where a Ray actor runs now (its current incarnation, from the GCS): ``name`` ("" when unnamed), ``pid`` (0
    when unknown) and ``node_id`` (hex, "" when unknown)."""

    name: str
    pid: int
    node_id: str


def actor_process(actor: Any) -> ActorProcess:
    """Returns where ``actor`` runs now, from Ray's GCS actor table (``ray._private.state``: the state API needs the
    dashboard, which a cluster may run without); an ``ActorProcess`` of unknowns when the GCS does not answer."""
    import ray._private.state

    try:
        info = ray._private.state.actors(actor_id=actor._actor_id.hex()) or {}
    except Exception:  # noqa: BLE001 - the GCS busy or away: unknown
        info = {}
    return ActorProcess(str(info.get("Name") or ""), int(info.get("Pid") or 0),
                        str((info.get("Address") or {}).get("NodeID") or ""))


def actor_stacks(actor: Any, timeout_s: float = 10.0) -> tuple[ActorProcess, str]:
    """Returns (where ``actor`` runs, its threads' stacks: ``process_stacks``)."""
    where = actor_process(actor)
    return where, process_stacks(where, timeout_s)


def process_stacks(where: ActorProcess, timeout_s: float = 10.0) -> str:
    """Returns the threads' stacks of the process at ``where`` (``dump_stacks`` run on its node: from this process
    when it is this node, else from a zero-CPU Ray task pinned to its node), or a line in parentheses saying why there
    are none within ``timeout_s`` seconds."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not where.pid:
        return "(no stacks: the GCS does not know the actor's process)"
    if where.node_id in ("", ray.get_runtime_context().get_node_id()):
        return dump_stacks(where.pid, timeout_s)
    task = ray.remote(dump_stacks).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(where.node_id, soft=False))
    try:
        return ray.get(task.remote(where.pid, timeout_s), timeout=timeout_s + 30.0)
    except Exception as err:  # noqa: BLE001 - a hang report must never fail for want of stacks
        return f"(no stacks: the task on node {where.node_id[:12]} failed: {type(err).__name__}: {err})"


SERVE_REPLICA_PREFIX = "SERVE_REPLICA::"  # Ray Serve names a replica's actor SERVE_REPLICA::<app>#<deployment>#<id>


def serve_stacks(app_name: str, timeout_s: float = 10.0) -> list[tuple[ActorProcess, str]]:
    """Returns (where, stacks) of every live replica of Serve application ``app_name`` (its actors in the GCS named
    ``SERVE_REPLICA::<app_name>#...``, each read by ``process_stacks``); [] when the GCS knows none. A request to
    the application went to one of them; Serve does not tell the caller which."""
    import ray._private.state

    try:
        actors = ray._private.state.actors() or {}
    except Exception:  # noqa: BLE001 - the GCS busy or away: none known
        actors = {}
    prefix = f"{SERVE_REPLICA_PREFIX}{app_name}#"
    replicas = [ActorProcess(str(info.get("Name") or ""), int(info.get("Pid") or 0),
                             str((info.get("Address") or {}).get("NodeID") or ""))
                for info in actors.values()
                if str(info.get("Name") or "").startswith(prefix) and info.get("State") == "ALIVE"]
    return [(where, process_stacks(where, timeout_s)) for where in sorted(replicas, key=lambda w: w.name)]


def restart_actor(actor: Any) -> None:
    """Kills ``actor``'s process so that Ray restarts it (within its ``max_restarts``; dead for good after them)."""
    import ray

    ray.kill(actor, no_restart=False)


class HangError(RuntimeError):
    """A remote call ran past its deadline under ``watchdog.on_hang=stop``: the message names the actor, the call,
    the deadline's key and where the process is stuck."""


@dataclass(frozen=True)
class Hang:
    """One remote call past its deadline.

    Attributes:
        who: the actor ("rollout actor 1 (rlray:rollout-1)", "environment host 0 (rlray:env-0)").
        call: the remote method ("generate", "update_weights", "step", ...).
        waited_s: seconds the call has run (queueing behind the actor's earlier calls excluded where the waiter
            knows it), at least ``deadline_s``.
        deadline_s: its deadline in seconds; ``key``: the config key that sets it (``watchdog.engine_call_s``).
        process: where the actor ran (pid and node, from the GCS).
        stacks: its threads' Python stacks (``dump_stacks``), or why there are none.
        action: what follows ("restart" or "stop", ``watchdog.on_hang``).
        then: what follows, for people, where the caller's own mechanism acts (a Serve request's retries), else "".
    """

    who: str
    call: str
    waited_s: float
    deadline_s: float
    key: str
    process: ActorProcess
    stacks: str
    action: str
    then: str = ""

    def headline(self) -> str:
        """Returns the report's first line: who, which call, how long, the deadline and what follows."""
        then = ("stopping the run (watchdog.on_hang=stop)" if self.action == "stop" else self.then or
                "restarting it (Ray restarts the process; its work runs again elsewhere or after the restart)")
        return (f"hang: {self.who} (pid {self.process.pid or '?'}, node {self.process.node_id[:12] or '?'}) has run "
                f"{self.call} for {self.waited_s:.1f} s, past {self.key}={self.deadline_s:g} s; {then}")

    def message(self, max_stack_chars: int | None = None) -> str:
        """Returns the headline and, below it, the process's stacks (their last ``max_stack_chars`` characters when
        given: the innermost frames of the last threads)."""
        stacks = self.stacks if max_stack_chars is None else self.stacks[-max_stack_chars:]
        return f"{self.headline()}\nstacks of pid {self.process.pid or '?'}:\n{stacks.rstrip()}"


class HangWatch:
    """Reports remote calls past their deadline and applies ``watchdog.on_hang`` (module docstring).

    Args:
        action: "restart" (kill the actor's process; Ray restarts it) or "stop" (raise ``HangError``).
        env_call_s: deadline of one call to an environment host, seconds (``watchdog.env_call_s``).
        engine_call_s: deadline of one generate call on a rollout actor, queueing excluded, seconds.
        weight_push_s: deadline of one weight push to a rollout actor, queueing excluded, seconds.
        reference_call_s: deadline of one logprobs call of a learner rank to the reference or teacher actor, queueing
            behind the other ranks' calls included, seconds (``watchdog.reference_call_s``).
        stacks_timeout_s: seconds to wait for a stuck process's stacks.
        alert: sends one alert message (kind "hang") through the run's alert path; None: the log line only. Set
            when the run's services are known (rank 0's ``OnlineRun.watch_hangs``; other ranks log only).
        stacks: returns (where an actor runs, its stacks) within a timeout in seconds (``actor_stacks``).
        restart: restarts an actor's process (``restart_actor``: Ray restarts it within its max_restarts).
        replica_stacks: returns (where, stacks) of every live replica of a Serve application within a timeout in
            seconds (``serve_stacks``).

    Attributes:
        hangs: calls reported past their deadline, over the run (``run/hangs``).
        restarts: actors restarted for a hang, over the run (``run/hang_restarts``).
        last: the latest report, or None.

    Raises:
        ValueError: an unknown action.
    """

    def __init__(self, action: str = "restart", *, env_call_s: float = math.inf, engine_call_s: float = math.inf,
                 weight_push_s: float = math.inf, reference_call_s: float = math.inf, stacks_timeout_s: float = 10.0,
                 alert: Callable[[str], None] | None = None,
                 stacks: Callable[[Any, float], tuple[ActorProcess, str]] = actor_stacks,
                 restart: Callable[[Any], None] = restart_actor,
                 replica_stacks: Callable[[str, float], list[tuple[ActorProcess, str]]] = serve_stacks) -> None:
        if action not in HANG_ACTIONS:
            raise ValueError(f"HangWatch: action={action!r}; use one of {HANG_ACTIONS}")
        self.action, self.stacks_timeout_s, self.alert = action, stacks_timeout_s, alert
        self.env_call_s, self.engine_call_s, self.weight_push_s = env_call_s, engine_call_s, weight_push_s
        self.reference_call_s = reference_call_s
        self._stacks, self._restart, self._replica_stacks = stacks, restart, replica_stacks
        self.hangs = 0
        self.restarts = 0
        self.last: Hang | None = None

    def hung(self, actor: Any, who: str, call: str, waited_s: float, deadline_s: float, key: str, *,
             stop_later: bool = False) -> Hang:
        """Reports ``actor``'s ``call`` past its deadline (stacks, ``rlray: hang`` log line, alert), then restarts the
        actor's process (``restart``: its pending calls fail with an actor error, which the waiter handles as a
        death) and returns the report, or raises.

        Args:
            actor: the actor's handle.
            who: the actor for people ("rollout actor 1"); its Ray name is added from the GCS.
            call: the remote method.
            waited_s: seconds the call has run.
            deadline_s: its deadline, seconds; ``key``: the config key that sets it.
            stop_later: with ``action="stop"``, restart the actor and return the report instead of raising: the
                caller raises ``HangError`` where the run can stop cleanly (a weight push found hung in stage 7 stops
                the run at the next rollout, in stages 1-3, which every rank agrees on).

        Raises:
            HangError: with ``action="stop"`` (and not ``stop_later``), after the report (its message is the report's).
        """
        process, stacks = self._stacks(actor, self.stacks_timeout_s)
        who = f"{who} ({process.name})" if process.name else who
        hang = self._report(Hang(who, call, waited_s, deadline_s, key, process, stacks, self.action))
        if self.action == "stop" and not stop_later:
            raise HangError(hang.message(ALERT_STACK_CHARS))
        try:
            self._restart(actor)
        except Exception as err:  # noqa: BLE001 - already dead: the waiter's fault path sees that too
            log.warning("could not restart %s: %s: %s", who, type(err).__name__, err)
        self.restarts += 1
        return hang

    def timed_out(self, app_name: str, who: str, call: str, waited_s: float, deadline_s: float, key: str,
                  then: str) -> Hang:
        """Reports a request to Serve application ``app_name`` that got no reply within its timeout (a reward or judge
        call; Serve cancelled it) with the stacks of every live replica of the application (one of them has it), then
        returns the report, or raises under ``action="stop"``. Nothing is restarted here: the caller's own mechanism
        acts (``then`` says what: the retries, then failed rewards or an error), and Serve restarts a replica whose
        health check fails.

        Args:
            app_name: the Serve application (``rlray-reward``, ``rlray-judge-<name>``).
            who: the application for people ("reward server 'rlray-reward'").
            call: the deployment method ("score", "judge").
            waited_s: seconds the request ran; ``deadline_s``: its timeout; ``key``: the config key that sets it.
            then: what the caller does next, for people.

        Raises:
            HangError: with ``action="stop"``, after the report (its message is the report's).
        """
        replicas = self._replica_stacks(app_name, self.stacks_timeout_s)
        if len(replicas) == 1:
            process, stacks = replicas[0]
            who = f"{who} ({process.name})"
        else:
            process = ActorProcess(app_name, 0, "")
            stacks = "\n".join(f"replica {w.name} (pid {w.pid or '?'}, node {w.node_id[:12] or '?'}):\n{text.rstrip()}"
                                for w, text in replicas) or f"(no stacks: the GCS knows no live replica of {app_name})"
        hang = self._report(Hang(who, call, waited_s, deadline_s, key, process, stacks, self.action, then))
        if self.action == "stop":
            raise HangError(hang.message(ALERT_STACK_CHARS))
        return hang

    def killed(self, hang: Hang) -> Hang:
        """Reports a call whose own time limit already killed its process (``hang``: its stacks taken first, by
        ``rlray.sandbox``; a fresh process serves the next call), with this watch's action; returns the report,
        counted in ``hangs`` and ``restarts``, or raises under ``action="stop"``.

        Raises:
            HangError: with ``action="stop"``, after the report (its message is the report's).
        """
        hang = self._report(dataclasses.replace(hang, action=self.action))
        self.restarts += 1  # the sandbox started a fresh process
        if self.action == "stop":
            raise HangError(hang.message(ALERT_STACK_CHARS))
        return hang

    def _report(self, hang: Hang) -> Hang:
        """Counts ``hang``, logs its ``rlray: hang`` line and sends its alert; returns it."""
        self.hangs += 1
        self.last = hang
        log.error("rlray: %s", hang.message())
        if self.alert is not None:
            try:
                self.alert(hang.message(ALERT_STACK_CHARS))
            except Exception as err:  # noqa: BLE001 - the report must reach the log and the action must run
                log.error("hang alert failed: %s: %s", type(err).__name__, err)
        return hang

    def metrics(self) -> dict[str, float]:
        """Returns the run's counts so far: {"run/hangs": ..., "run/hang_restarts": ...}."""
        return {"run/hangs": float(self.hangs), "run/hang_restarts": float(self.restarts)}


def own_stacks() -> str:
    """Returns every thread's Python stack of this process, as faulthandler writes them (``dump_stacks``' format)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


@dataclass(frozen=True)
class HangAction:
    """What a learner rank does after it reported a hang of its own (``StepDeadline``, the collective deadline:
    ``rlray.run.collective_watch``), under Ray Train: ``watchdog.on_hang``'s action for the learner group
    (``rlray.run.session.hang_action``).

    Attributes:
        says: the report's last words, what the action does ("exiting the rank (Ray Train restarts the group)").
        run: the action, called with the report's headline (its first line) on the watching thread.
    """

    says: str
    run: Callable[[str], None]


class StepDeadline:
    """A learner rank's step deadline (``watchdog.learner_step_s``), watched from a timer thread: a step that runs past
    it (a rank that never reaches its collective, or waits in one for a rank that never comes) is reported once with
    this process's stacks through ``report``, then ``on_expiry`` runs (the session's ``hang_action``: under Ray Train
    the rank exits, and the group restarts from the newest snapshot or, under ``watchdog.on_hang=stop``, the run ends
    FAILED). Every rank watches its own steps, so each stuck rank names where it waits.

    Args:
        deadline_s: seconds one step (stages 1-8) may run.
        who: the rank for people ("learner rank 1").
        report: sends the report (log line and alert).
        on_expiry: runs after the report, on the timer thread; None: nothing.
    """

    def __init__(self, deadline_s: float, who: str, report: Callable[[str], None],
                 on_expiry: HangAction | None = None) -> None:
        self.deadline_s, self.who, self.report, self.on_expiry = deadline_s, who, report, on_expiry
        self._timer: Any = None
        self.reports = 0

    def arm(self, step: int) -> None:
        """Starts the deadline of 1-based ``step`` (ending the previous one's)."""
        import threading

        self.disarm()
        if math.isfinite(self.deadline_s):
            self._timer = threading.Timer(self.deadline_s, self._expire, args=(step,))
            self._timer.daemon = True
            self._timer.start()

    def disarm(self) -> None:
        """Ends the running step's deadline (it finished)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, step: int) -> None:
        self.reports += 1
        then = f"; {self.on_expiry.says}" if self.on_expiry is not None else ""
        head = (f"hang: {self.who} (pid {os.getpid()}) has run step {step} for {self.deadline_s:g} s, past "
                f"watchdog.learner_step_s={self.deadline_s:g} s{then}\nstacks of pid {os.getpid()}:\n")
        stacks = own_stacks().rstrip()
        log.error("rlray: %s%s", head, stacks)
        try:
            self.report(head + stacks[-ALERT_STACK_CHARS:])
        except Exception as err:  # noqa: BLE001 - the action must run
            log.error("hang alert failed: %s: %s", type(err).__name__, err)
        if self.on_expiry is not None:
            self.on_expiry.run(head.partition("\n")[0])
