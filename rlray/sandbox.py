"""Child processes that run code with a timeout, and untrusted code with resource limits.

The isolation that environments (``rlray.envs.host``: one child per sandboxed episode) and reward functions
(``rlray.reward.scorer``, ``rlray.reward.server``) share; a base module (DESIGN.md, lines 1-2) that imports no
other rlray package, so both sit above it.

``ProcessSandbox`` builds a callable in a fresh child process (``multiprocessing`` spawn) and calls it one
request at a time over a pipe. The parent enforces the time limit from outside: a call that runs past
``timeout_s`` gets the child SIGKILLed (a hung or busy function cannot ignore that, and no signal handler
runs in the caller, so it works from any thread of a Ray actor or a Serve replica), and a fresh child is
started for the next call. A child that dies (a memory cap, a crash) is restarted the same way.

No silent hang: every child writes its threads' Python stacks on ``rlray.hangs.STACK_SIGNAL``
(``enable_stack_dumps``, registered before any limit or user code), and the parent takes them
(``rlray.hangs.dump_stacks``) before it kills a child past its time limit; ``SandboxTimeout`` carries them, so the
caller's hang report says where the code was stuck.

Untrusted code (``Limits.untrusted``) additionally runs with:

- an address-space cap (``resource.setrlimit(RLIMIT_AS)``, soft and hard, so the code cannot raise it
  again without privileges): an allocation past it raises ``MemoryError`` in the child or kills it;
- no core dumps (``RLIMIT_CORE`` 0);
- an environment emptied down to a few locale and path variables, so credentials in the parent's
  environment (AWS keys, tokens) are not visible to it;
- a private temporary folder as its working directory.

Children are not daemonic (so a sandbox may start sandboxes of its own: the reward Serve replica's scorer
sandbox runs each user function in one), stop when their parent exits (a watchdog thread in the child
checks the parent pid every second) and are stopped before multiprocessing joins children at interpreter
exit (``multiprocessing.util.Finalize`` with an exit priority).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import resource
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.util import Finalize
from typing import Any

from rlray.hangs import dump_stacks, enable_stack_dumps, stack_file

_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")  # what an untrusted child keeps of the environment


class SandboxError(RuntimeError):
    """The code in the sandbox raised; ``str()`` is ``"<type name>: <message>"``.

    Attributes:
        type_name: the exception's class name.
        original: the exception itself when it could be pickled across the pipe, else None.
    """

    def __init__(self, type_name: str, message: str, original: BaseException | None = None) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.original = original


class SandboxTimeout(TimeoutError):
    """A call (or the child's start) ran past its time limit; the child was killed.

    Attributes:
        pid: the killed child's process id (0 when it never started).
        stacks: its threads' Python stacks, taken from it just before the kill (``rlray.hangs.dump_stacks``: where the
            code was stuck), or a line in parentheses saying why there are none ("" for a start past its limit).
    """

    def __init__(self, message: str, pid: int = 0, stacks: str = "") -> None:
        super().__init__(message)
        self.pid, self.stacks = pid, stacks


class SandboxCrashed(RuntimeError):
    """The child process died during a call (a memory cap or a crash); it was restarted."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of a sandbox child.

    Attributes:
        untrusted: apply the limits below, empty the environment and run in a private temp folder.
        memory_gib: address-space cap of the child in GiB (RLIMIT_AS), when untrusted.
    """

    untrusted: bool = False
    memory_gib: float = 2.0


def _apply_limits(limits: Limits) -> None:
    """Applies ``limits`` to this (child) process before any user code is loaded."""
    if not limits.untrusted:
        return
    cap = int(limits.memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    keep = {k: os.environ[k] for k in _KEEP_ENV if k in os.environ}
    os.environ.clear()
    os.environ.update(keep)
    os.chdir(tempfile.mkdtemp(prefix="rlray-sandbox-"))


def _exit_with_parent(parent_pid: int) -> None:
    """Child watchdog: exits this process once its parent is gone (re-parented to another pid)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _describe(err: BaseException) -> tuple[str, str, BaseException | None]:
    """Returns (type name, message, the exception if it pickles else None)."""
    try:
        original = pickle.loads(pickle.dumps(err))
    except Exception:  # exceptions of user code need not pickle
        original = None
    return type(err).__name__, str(err), original


def _child_main(conn: Any, factory: Callable[..., Callable], kwargs: dict, limits: Limits, parent_pid: int) -> None:
    """Child process: applies the limits, builds ``factory(**kwargs)``, then answers calls until None or EOF."""
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        enable_stack_dumps()  # before the limits: its file opens where the parent looks (its TMPDIR, not emptied yet)
        _apply_limits(limits)
        fn = factory(**kwargs)
    except BaseException as err:  # reported to the parent, which raises it
        conn.send(("error", _describe(err)))
        return
    conn.send(("ready", None))
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        if args is None:
            return
        try:
            reply = ("ok", fn(*args))
        except BaseException as err:  # noqa: BLE001 - any failure of the code in the sandbox is its answer
            reply = ("error", _describe(err))
        try:
            conn.send(reply)
        except Exception as err:  # an answer that does not pickle
            conn.send(("error", ("UnpicklableResult", f"the result could not be sent back: {err}", None)))


def _stop_child(proc: Any, conn: Any) -> None:
    """Asks the child to stop, then kills it if it has not within 1 s; closes the pipe."""
    try:
        conn.send(None)
    except (OSError, ValueError):
        pass
    proc.join(timeout=1.0)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5.0)
    conn.close()
    stack_file(proc.pid).unlink(missing_ok=True)  # the child's stack file (enable_stack_dumps): one per child


class ProcessSandbox:
    """``factory(**kwargs)`` built in a child process and called one request at a time, with a time limit.

    Args:
        factory: a picklable callable (a module-level function) that returns the callable to serve; it runs
            in the child, so imports and user code load there, never in this process.
        kwargs: its keyword arguments (picklable).
        timeout_s: seconds one call may take (wall clock); past it the child is killed and restarted.
        start_timeout_s: seconds the child may take to build the callable.
        limits: resource limits of the child (untrusted code).
        name: what the sandbox runs, for error messages.
        stacks_timeout_s: seconds to wait for the stacks of a child past ``timeout_s`` before it is killed.

    Raises:
        SandboxError: ``factory`` raised in the child (its type and message are kept).
        SandboxTimeout: the child did not build the callable within ``start_timeout_s``.
    """

    def __init__(
        self,
        factory: Callable[..., Callable],
        kwargs: dict | None = None,
        *,
        timeout_s: float,
        start_timeout_s: float = 300.0,
        limits: Limits | None = None,
        name: str = "sandbox",
        stacks_timeout_s: float = 5.0,
    ) -> None:
        self.factory, self.kwargs, self.name = factory, dict(kwargs or {}), name
        self.stacks_timeout_s = stacks_timeout_s
        self.timeout_s, self.start_timeout_s, self.limits = timeout_s, start_timeout_s, limits or Limits()
        self._lock = threading.Lock()
        self._finalizer: Finalize | None = None
        self._closed = False
        self._start()

    @property
    def pid(self) -> int | None:
        """Returns the child's process id (None once closed)."""
        return self._proc.pid if self._finalizer is not None else None

    def __call__(self, *args: Any) -> Any:
        """Returns the sandboxed callable's result for ``args`` (thread-safe: calls run one at a time).

        Raises:
            SandboxTimeout: the call ran past ``timeout_s`` (the child was killed and restarted; the error carries its
                pid and the stacks taken from it first).
            SandboxCrashed: the child died during the call (restarted).
            SandboxError: the callable raised (the child keeps serving).
        """
        with self._lock:
            if self._closed:
                raise SandboxCrashed(f"{self.name}: the sandbox is closed")
            if self._finalizer is None or not self._proc.is_alive():
                self._stop(kill=True)
                self._start()
            self._conn.send(args)
            if not self._conn.poll(self.timeout_s):
                pid = self._proc.pid
                stacks = dump_stacks(pid, self.stacks_timeout_s)  # where it is stuck, from the process, before the kill
                self._stop(kill=True)
                self._start()
                raise SandboxTimeout(f"{self.name}: a call took longer than {self.timeout_s:g} s; the process was killed",
                                     pid, stacks)
            try:
                status, value = self._conn.recv()
            except (EOFError, OSError):
                self._proc.join(timeout=5.0)
                code = self._proc.exitcode
                self._stop(kill=True)
                self._start()
                raise SandboxCrashed(f"{self.name}: the process died during a call (exit code {code})") from None
        if status == "ok":
            return value
        raise SandboxError(*value)

    def close(self) -> None:
        """Waits for a call in progress, then stops the child process."""
        with self._lock:
            self._closed = True
            self._stop()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        args = (child, self.factory, self.kwargs, self.limits, os.getpid())
        self._proc = ctx.Process(target=_child_main, args=args, daemon=False, name=f"rlray-{self.name}")
        self._proc.start()
        child.close()
        self._finalizer = Finalize(self, _stop_child, args=(self._proc, self._conn), exitpriority=10)
        try:
            ready = self._conn.poll(self.start_timeout_s)
            status, value = self._conn.recv() if ready else ("timeout", None)
        except (EOFError, OSError):
            status, value = "error", ("ChildDied", f"the process exited while starting (exit code {self._proc.exitcode})", None)
        if status == "ready":
            return
        self._stop()
        if status == "timeout":
            raise SandboxTimeout(f"{self.name}: the process did not start within {self.start_timeout_s:g} s")
        raise SandboxError(*value)

    def _stop(self, *, kill: bool = False) -> None:
        """Stops the child (at once with ``kill``: it may be hung); a no-op when none runs."""
        if kill and self._finalizer is not None and self._proc.is_alive():
            self._proc.kill()
        if self._finalizer is not None:
            finalizer, self._finalizer = self._finalizer, None
            finalizer()  # runs _stop_child once and unregisters it
