"""Environment servers as processes: start one in the Python environment it names, wait until it is healthy, restart
it when it dies, bound the sessions open on it, stop it with the run.

Environments from elsewhere (OpenEnv, verifiers) run as servers beside the run, each in its own Python environment
when its pins differ from rlray's (DESIGN.md, Environments). This module is the protocol-free part; a protocol's
client (``rlray.envs.servers.openenv``) opens its sessions through a ``ServerProcess``.

The API (stable; other protocols build on it):

- ``ServerSpec``: what to run (a command in a Python environment) or where to reach it (a URL), its health path, its
  session bound and restart budget. Plain values, no config import.
- ``ServerProcess(spec, log_dir)``: one server. ``start()`` runs the command (or checks the URL) and waits until
  ``GET <url><health_path>`` answers 2xx; ``url`` is where it listens; ``generation`` counts its (re)starts;
  ``session(timeout_s)`` is a context manager that holds one of ``spec.max_sessions`` slots while a client session
  is open and yields a ``Lease``; ``check()`` restarts a dead server (within ``spec.max_restarts``); ``stop()`` ends
  it. ``restarts`` counts restarts; ``failed`` says the restart budget is spent (every new session then raises
  ``ServerDown``).
- ``ServerSupervisor(specs, log_dir)``: many servers, started together (``start()``), each one's ``check()`` run by
  a watcher thread every ``poll_s`` seconds, stopped together (``stop()``, also at interpreter exit).
  ``restarts_here()`` sums ``restarts()`` over every supervisor started in this process (an environment host's
  ``env.servers`` and its agents' verifiers bridges alike: the ``env/server_restarts/<name>`` metric).
- Errors: ``ServerStartError`` (did not become healthy: the message has the command and its log's last lines),
  ``ServerDown`` (dead and not restarted), ``ServerBusy`` (no free session slot in time). All are
  ``ServerError``s; a client turns them into its episode's failure, never the run's.

How a started server runs:
- ``{host}`` and ``{port}`` in the command are replaced by ``spec.host`` (127.0.0.1 unless configured) and a free
  port chosen at the first start (kept across restarts, so the URL stays the same); ``RLRAY_SERVER_HOST`` and
  ``RLRAY_SERVER_PORT`` are set too.
- ``spec.python``: a virtual environment's folder (``.venvs/openenv``) or an interpreter. A first word ``python`` of
  the command becomes that interpreter, the environment's ``bin/`` goes first on ``PATH``, ``VIRTUAL_ENV`` is set,
  and ``PYTHONPATH``/``PYTHONHOME`` are removed (unless ``spec.env`` sets them), so the server never imports
  rlray's packages.
- The server runs under a small guard process (this interpreter, standard library only) that holds a pipe from the
  process that started it: when that process ends in any way (a killed Ray actor included) the pipe closes and the
  guard stops the server. Output goes to ``<log_dir>/<name>.log``; with no ``log_dir``, to ``$RLRAY_SERVER_LOG_DIR``
  (an environment host sets it to its folder in the run's output, ``default_log_dir``), else a temporary folder.
- Restarts use tenacity: a dead server is started again up to ``spec.max_restarts`` times over the run, each start
  tried ``START_ATTEMPTS`` times with exponential back-off. Sessions opened on the previous process are gone with it:
  their episodes fail (the client raises), counted, and the run goes on.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_attempt, stop_after_delay, wait_exponential

log = logging.getLogger(__name__)

START_ATTEMPTS = 3  # tries of one (re)start before the server counts as down
LOG_TAIL_LINES = 20  # lines of the server's log quoted when it does not start

# The guard: runs the server (argv[1:]) in its process group, stops it when stdin closes (the parent is gone) or on
# SIGTERM, and exits with the server's status. The server gets SIGTERM from the kernel if the guard itself dies
# (PR_SET_PDEATHSIG, Linux): Ray kills an actor's child processes with SIGKILL, and a guard killed so left its server
# running. Standard library only: it runs in rlray's interpreter with -I.
_GUARD = r"""
import ctypes, os, signal, subprocess, sys, threading, time
def die_with_guard():
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass
p = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, preexec_fn=die_with_guard)
signal.signal(signal.SIGTERM, lambda *_: p.terminate())
def orphaned():
    sys.stdin.buffer.read()
    p.terminate()
    time.sleep(5)
    p.kill()
threading.Thread(target=orphaned, daemon=True).start()
code = p.wait()
os._exit(code if code >= 0 else 128 - code)
"""


LOG_DIR_VAR = "RLRAY_SERVER_LOG_DIR"  # the servers' log folder when none is given (set by the environment hosts)


def default_log_dir() -> str:
    """Returns ``$RLRAY_SERVER_LOG_DIR``, else a new temporary folder: where servers started without a ``log_dir``
    write their logs."""
    return os.environ.get(LOG_DIR_VAR) or tempfile.mkdtemp(prefix="rlray-servers-")


class ServerError(RuntimeError):
    """A server could not serve a session (the base of the errors below)."""


class ServerStartError(ServerError):
    """A server did not become healthy in time, or exited while starting (the message quotes its log)."""


class ServerDown(ServerError):
    """A server died and was not (or could not be) restarted."""


class ServerBusy(ServerError):
    """Every session slot of a server stayed taken for the whole wait."""


@dataclass(frozen=True)
class ServerSpec:
    """One environment server: started by rlray (``command``) or reached at ``url``.

    Attributes:
        name: the server's name (logs, errors, its log file).
        command: the command that starts it (argv; ``{host}`` and ``{port}`` are substituted); () with ``url``.
        url: the base URL of a server already running ("http://127.0.0.1:8000"); "" with ``command``.
        python: the Python environment the command runs in: a virtual environment's folder or an interpreter's path;
            "" runs the command as written (``python`` is then this interpreter).
        cwd: the command's working folder ("" : the current one).
        env: extra environment variables of the command.
        host: the address the server is told to bind (``{host}``).
        health_path: the path that answers 2xx once the server serves ("/health").
        max_sessions: sessions open on it at once (the server's own limit, e.g. OpenEnv's max_concurrent_envs).
        start_timeout_s: seconds one start may take until healthy.
        max_restarts: restarts over the run after it dies; then it stays down (sessions fail, counted).
    """

    name: str
    command: tuple[str, ...] = ()
    url: str = ""
    python: str = ""
    cwd: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    health_path: str = "/health"
    max_sessions: int = 1
    start_timeout_s: float = 120.0
    max_restarts: int = 3

    def __post_init__(self) -> None:
        if bool(self.command) == bool(self.url):
            raise ValueError(f"server {self.name!r}: give either command (rlray starts it) or url, not both or neither")
        if self.max_sessions < 1:
            raise ValueError(f"server {self.name!r}: max_sessions must be >= 1, got {self.max_sessions}")

    def interpreter(self) -> str:
        """Returns the Python interpreter of ``python`` (a folder's ``bin/python``), or this one when it is "".

        Raises:
            ServerStartError: ``python`` names neither a virtual environment nor an interpreter.
        """
        if not self.python:
            return sys.executable
        path = Path(self.python).expanduser()
        exe = path / "bin" / "python" if path.is_dir() else path
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            raise ServerStartError(f"server {self.name!r}: python={self.python!r} is neither a virtual environment "
                                   f"(no {exe}) nor an interpreter; build it first (`make install` builds .venvs/*)")
        return str(exe)


@dataclass(frozen=True)
class Lease:
    """One session slot held on a server: where it listens now and which of its processes answers.

    Attributes:
        url: the server's base URL ("http://127.0.0.1:PORT").
        generation: its (re)start count when the slot was taken (1 for the first process).
    """

    url: str
    generation: int


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port that nothing listens on at ``host`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One environment server (module docstring): started, health-checked, restarted, bounded, stopped.

    Args:
        spec: what to run or reach.
        log_dir: folder of the server's log file (None: ``default_log_dir()``).

    Attributes:
        generation: starts so far (0 before ``start``); restarts: starts after the first; failed: out of restarts.
    """

    def __init__(self, spec: ServerSpec, log_dir: str | None = None) -> None:
        self.spec = spec
        self.log_path = Path(log_dir or default_log_dir()) / f"{spec.name}.log"
        self.generation, self.restarts, self.failed = 0, 0, False
        self._port = 0
        self._proc: subprocess.Popen | None = None
        self._slots = threading.BoundedSemaphore(spec.max_sessions)
        self._lock = threading.RLock()
        self._stopping = False

    @property
    def url(self) -> str:
        """Returns the server's base URL (the configured one, or http://host:port of the started process)."""
        return self.spec.url.rstrip("/") if self.spec.url else f"http://{self.spec.host}:{self._port}"

    @property
    def pid(self) -> int | None:
        """Returns the process id of the server's guard (its process group's id), None when not running."""
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        """Returns True while the started process runs (always True for a server reached at a URL)."""
        return bool(self.spec.url) or (self._proc is not None and self._proc.poll() is None)

    def start(self) -> str:
        """Starts the server (or checks the URL) and waits until it is healthy; returns its URL.

        Raises:
            ServerStartError: it did not answer ``health_path`` within ``start_timeout_s`` (or exited first), after
                ``START_ATTEMPTS`` tries.
        """
        with self._lock:
            self._stopping = False
            try:
                for attempt in Retrying(stop=stop_after_attempt(START_ATTEMPTS), reraise=True,
                                        wait=wait_exponential(multiplier=0.5, max=5.0),
                                        retry=retry_if_exception_type(ServerStartError)):
                    with attempt:
                        self._start_once()
            except ServerStartError:
                self.failed = True
                raise
            self.generation += 1
            log.info("server %s is healthy at %s (generation %d)", self.spec.name, self.url, self.generation)
            return self.url

    def check(self) -> bool:
        """Restarts the server when its process has died (within ``max_restarts``); returns True when it serves.

        A server reached at a URL is not restarted (True). A failed restart marks it ``failed``: sessions then raise
        ``ServerDown``, and the run goes on.
        """
        with self._lock:
            if self.alive():
                return True
            if self.failed or self._stopping:
                return False
            code = None if self._proc is None else self._proc.returncode
            if self.restarts >= self.spec.max_restarts:
                self.failed = True
                log.error("server %s died (exit %s) and has used its %d restarts: its sessions fail from now on",
                          self.spec.name, code, self.spec.max_restarts)
                return False
            self.restarts += 1
            log.warning("server %s died (exit %s); restart %d of %d", self.spec.name, code, self.restarts,
                        self.spec.max_restarts)
            try:
                self.start()
            except ServerStartError as err:
                log.error("server %s did not restart: %s", self.spec.name, err)
                return False
            return True

    @contextlib.contextmanager
    def session(self, timeout_s: float) -> Iterator[Lease]:
        """Holds one of ``max_sessions`` slots while the caller's session is open; yields where to open it.

        Args:
            timeout_s: seconds to wait for a free slot.

        Raises:
            ServerDown: the server is dead and not restarted (it is checked, and restarted when it may be, first).
            ServerBusy: no slot freed within ``timeout_s``.
        """
        if not self.check():
            raise ServerDown(f"server {self.spec.name!r} is down (restarts used: {self.restarts} of "
                             f"{self.spec.max_restarts}; log {self.log_path})")
        if not self._slots.acquire(timeout=timeout_s):
            raise ServerBusy(f"server {self.spec.name!r}: all {self.spec.max_sessions} sessions stayed taken for "
                             f"{timeout_s:g} s (raise its max_sessions, and the server's own limit with it)")
        try:
            yield Lease(self.url, self.generation)
        finally:
            self._slots.release()

    def stop(self, grace_s: float = 5.0) -> None:
        """Stops the server's process group (SIGTERM, then SIGKILL after ``grace_s`` seconds); nothing for a URL."""
        with self._lock:
            self._stopping = True
            proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is not None:  # the guard is gone; what the server started may still run in its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()

    # ---- internals ----------------------------------------------------------------------------------------------
    def _start_once(self) -> None:
        """Starts the process (a started server) and waits for health; raises ServerStartError."""
        if not self.spec.url:
            self._spawn()
        try:
            for attempt in Retrying(stop=stop_after_delay(self.spec.start_timeout_s), wait=wait_exponential(0.05, max=1.0),
                                    retry=retry_if_exception_type(_NotReady)):
                with attempt:
                    self._probe()
        except RetryError as err:
            self._kill_quietly()
            raise ServerStartError(f"server {self.spec.name!r} did not answer {self.url}{self.spec.health_path} within "
                                   f"{self.spec.start_timeout_s:g} s ({err.last_attempt.exception()}){self._how()}") from None

    def _probe(self) -> None:
        """Returns when the health path answers 2xx; raises _NotReady while it does not, ServerStartError when the
        process has exited."""
        if not self.alive():
            code = None if self._proc is None else self._proc.returncode
            raise ServerStartError(f"server {self.spec.name!r} exited with status {code} while starting{self._how()}")
        try:
            with urllib.request.urlopen(self.url + self.spec.health_path, timeout=2.0) as reply:  # noqa: S310 - our URL
                if 200 <= reply.status < 300:
                    return
                raise _NotReady(f"HTTP {reply.status}")
        except (urllib.error.URLError, OSError) as err:
            raise _NotReady(str(err)) from None

    def _spawn(self) -> None:
        """Starts the command under the guard, in a new process group, output to the log file."""
        self._kill_quietly()
        spec = self.spec
        python = spec.interpreter()
        if not self._port:
            self._port = free_port(spec.host)
        words = [w.replace("{host}", spec.host).replace("{port}", str(self._port)) for w in spec.command]
        if words[0] == "python":
            words[0] = python
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        if spec.python:
            root = Path(python).parent.parent
            env["PATH"] = f"{root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
            env["VIRTUAL_ENV"] = str(root)
        env.update({"RLRAY_SERVER_HOST": spec.host, "RLRAY_SERVER_PORT": str(self._port), **spec.env})
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"\n---- rlray: starting {shlex.join(words)} (cwd {spec.cwd or os.getcwd()})\n".encode())
            out.flush()
            self._proc = subprocess.Popen([sys.executable, "-I", "-c", _GUARD, *words], stdin=subprocess.PIPE,
                                          stdout=out, stderr=subprocess.STDOUT, cwd=spec.cwd or None, env=env,
                                          start_new_session=True)

    def _kill_quietly(self) -> None:
        """Kills a previous process group, if any, without waiting long: also when its guard and server already
        exited (a crashed server), since a process the server started (a worker it forked) stays in the group and
        would outlive it."""
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)

    def _how(self) -> str:
        """Returns ': command ... ; the last lines of its log: ...' for a start error ('' for a URL)."""
        if self.spec.url:
            return ""
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError:
            tail = []
        return f"; command {shlex.join(self.spec.command)} in {self.spec.python or sys.executable}; log {self.log_path}:\n" + (
            "\n".join(tail))


class _NotReady(Exception):
    """The health path did not answer 2xx yet."""


class ServerSupervisor:
    """Many ``ServerProcess``es: started together, watched by one thread (dead ones restarted), stopped together.

    Args:
        specs: the servers.
        log_dir: folder of their log files (None: ``default_log_dir()``).
        poll_s: seconds between the watcher's checks.

    Raises:
        ValueError: two specs share a name.
    """

    def __init__(self, specs: list[ServerSpec], log_dir: str | None = None, poll_s: float = 0.5) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"server names must be unique, got {names}")
        folder = log_dir or default_log_dir()
        self.servers = {s.name: ServerProcess(s, folder) for s in specs}
        self._poll_s, self._done = poll_s, threading.Event()
        self._watcher: threading.Thread | None = None

    def __getitem__(self, name: str) -> ServerProcess:
        """Returns the server named ``name`` (KeyError when there is none)."""
        return self.servers[name]

    def start(self) -> dict[str, str]:
        """Starts every server (in parallel threads) and the watcher; returns {name: url}.

        Raises:
            ServerStartError: a server did not start (the others are stopped).
        """
        errors: list[ServerStartError] = []

        def one(server: ServerProcess) -> None:
            try:
                server.start()
            except ServerStartError as err:
                errors.append(err)

        threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in self.servers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop()
            raise errors[0]
        atexit.register(self.stop)
        _STARTED.add(self)
        self._watcher = threading.Thread(target=self._watch, name="rlray-server-watcher", daemon=True)
        self._watcher.start()
        return {name: s.url for name, s in self.servers.items()}

    def restarts(self) -> dict[str, int]:
        """Returns {name: restarts so far}."""
        return {name: s.restarts for name, s in self.servers.items()}

    def stop(self) -> None:
        """Stops the watcher and every server (idempotent)."""
        self._done.set()
        for server in self.servers.values():
            server.stop()

    def _watch(self) -> None:
        while not self._done.wait(self._poll_s):
            for server in self.servers.values():
                try:
                    server.check()
                except Exception:  # noqa: BLE001 - the watcher must outlive any one server's trouble
                    log.exception("checking server %s failed", server.spec.name)


_STARTED: weakref.WeakSet[ServerSupervisor] = weakref.WeakSet()  # the supervisors started in this process


def restarts_here() -> dict[str, int]:
    """Returns {server name: restarts so far} over every ``ServerSupervisor`` started in this process (a name that
    several supervisors run is summed); {} when none was started."""
    out: dict[str, int] = {}
    for sup in list(_STARTED):
        for name, count in sup.restarts().items():
            out[name] = out.get(name, 0) + count
    return out
