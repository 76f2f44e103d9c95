"""The server supervisor (rlray.envs.servers.supervisor) on a tiny HTTP server script: start in a Python environment,
health, a killed server restarted on the same URL, the restart budget, start failures quoting the log, the session
bound, stop, and a server that stops when the process that started it is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from rlray.envs.servers import (
    ServerBusy,
    ServerDown,
    ServerProcess,
    ServerSpec,
    ServerStartError,
    ServerSupervisor,
    restarts_here,
)

SCRIPT = str(Path(__file__).parents[2] / "fixtures" / "tiny_http_server.py")


def spec(name: str = "tiny", *extra: str, **kw) -> ServerSpec:
    return ServerSpec(name, command=("python", SCRIPT, "--host", "{host}", "--port", "{port}", *extra), **kw)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.read().decode()


def wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie child of this process counts as gone
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def wait_dead(server: ServerProcess, timeout_s: float = 15.0) -> bool:
    """Waits until the supervisor itself sees the guard exited (alive() False). A guard with a thread shows 'Z' in
    /proc while that thread still exits, and waitpid cannot reap it yet: wait_gone alone would race check()."""
    deadline = time.monotonic() + timeout_s
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not server.alive()


def test_starts_in_its_own_python_environment_on_loopback(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/rlray/would/leak")
    server = ServerProcess(spec(python=str(venv)), str(tmp_path / "logs"))
    try:
        url = server.start()
        assert url.startswith("http://127.0.0.1:") and server.generation == 1 and server.restarts == 0
        exe, pythonpath = get(url + "/python").split("|")
        assert Path(exe).parent == venv / "bin"  # the venv's interpreter, not rlray's
        assert pythonpath == ""  # rlray's import path does not reach the server
        assert "starting" in server.log_path.read_text()
    finally:
        server.stop()


def test_a_killed_server_is_restarted_on_the_same_url_until_its_budget_is_spent(tmp_path):
    server = ServerProcess(spec(max_restarts=1), str(tmp_path))
    try:
        url = server.start()
        with server.session(1.0) as lease:
            assert (lease.url, lease.generation) == (url, 1)
        first = int(get(url + "/pid"))
        os.kill(first, signal.SIGKILL)
        assert wait_dead(server)  # the guard exits with its server
        assert server.check() is True
        assert (server.generation, server.restarts, server.url) == (2, 1, url)
        second = int(get(url + "/pid"))
        assert second != first
        with server.session(1.0) as lease:
            assert lease.generation == 2
        os.kill(second, signal.SIGKILL)
        assert wait_dead(server)
        assert server.check() is False and server.failed  # max_restarts=1 is spent
        with pytest.raises(ServerDown, match="restarts used: 1 of 1"), server.session(1.0):
            pass
    finally:
        server.stop()


def test_the_supervisor_restarts_a_dead_server_by_itself(tmp_path):
    sup = ServerSupervisor([spec("a"), spec("b")], str(tmp_path), poll_s=0.1)
    try:
        urls = sup.start()
        assert set(urls) == {"a", "b"} and urls["a"] != urls["b"]
        os.kill(int(get(urls["a"] + "/pid")), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while sup["a"].generation < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sup.restarts() == {"a": 1, "b": 0}
        assert get(urls["a"] + "/health") == "ok"
    finally:
        sup.stop()
    assert not sup["a"].alive() and not sup["b"].alive()


def test_restarts_here_sums_every_supervisor_of_the_process(tmp_path):
    """What an environment host reports as env/server_restarts/<name>: its env.servers' supervisor and its agents'
    bridges' supervisors together; a name that two of them run is summed."""
    one = ServerSupervisor([spec("here-shared")], str(tmp_path / "one"), poll_s=0.1)
    two = ServerSupervisor([spec("here-shared"), spec("here-only")], str(tmp_path / "two"), poll_s=0.1)
    try:
        one.start(), two.start()
        assert {k: v for k, v in restarts_here().items() if k.startswith("here-")} == {"here-shared": 0, "here-only": 0}
        for sup, want in ((one, 1), (two, 2)):
            os.kill(int(get(sup["here-shared"].url + "/pid")), signal.SIGKILL)
            deadline = time.monotonic() + 30
            while sup["here-shared"].generation < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert restarts_here()["here-shared"] == want and restarts_here()["here-only"] == 0
    finally:
        one.stop(), two.stop()
    assert one["here-shared"].log_path == tmp_path / "one" / "here-shared.log"


def test_the_default_log_folder_is_the_hosts(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRAY_SERVER_LOG_DIR", str(tmp_path / "run" / "servers"))
    assert ServerProcess(spec("logged")).log_path == tmp_path / "run" / "servers" / "logged.log"
    monkeypatch.delenv("RLRAY_SERVER_LOG_DIR")
    assert ServerProcess(spec("logged")).log_path.parent.name.startswith("rlray-servers-")


def test_a_server_that_exits_at_start_is_an_error_quoting_its_log(tmp_path):
    server = ServerProcess(spec("bad", "--exit-at-start"), str(tmp_path))
    with pytest.raises(ServerStartError) as err:
        server.start()
    assert "exited with status 3" in str(err.value) and "tiny server: refusing to start" in str(err.value)
    assert server.failed


def test_an_unhealthy_server_times_out_and_is_stopped(tmp_path):
    server = ServerProcess(spec("sick", "--fail-health", start_timeout_s=1.0), str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match="did not answer .*/health within 1 s"):
        server.start()
    assert time.monotonic() - t0 < 20  # 3 attempts of 1 s plus back-off
    assert not server.alive()


def test_a_missing_python_environment_is_named(tmp_path):
    with pytest.raises(ServerStartError, match=r"python='.*nowhere' is neither a virtual environment"):
        ServerProcess(spec(python=str(tmp_path / "nowhere")), str(tmp_path)).start()


def test_sessions_are_bounded(tmp_path):
    server = ServerProcess(spec(max_sessions=2), str(tmp_path))
    try:
        server.start()
        with server.session(1.0), server.session(1.0):
            t0 = time.monotonic()
            with pytest.raises(ServerBusy, match="all 2 sessions stayed taken for 0.2 s"), server.session(0.2):
                pass
            assert time.monotonic() - t0 >= 0.2
        with server.session(0.2):  # freed again
            pass
    finally:
        server.stop()


def test_stop_ends_the_process_group(tmp_path):
    server = ServerProcess(spec(), str(tmp_path))
    url = server.start()
    pid = int(get(url + "/pid"))
    server.stop()
    assert wait_gone(pid) and not server.alive()


def test_url_servers_are_checked_not_started(tmp_path):
    started = ServerProcess(spec(), str(tmp_path))
    try:
        url = started.start()
        reached = ServerProcess(ServerSpec("far", url=url + "/"), str(tmp_path))
        assert reached.start() == url and reached.check() and reached.pid is None
    finally:
        started.stop()
    with pytest.raises(ValueError, match="either command .* or url"):
        ServerSpec("both", command=("x",), url="http://127.0.0.1:1")


def test_the_server_stops_when_the_process_that_started_it_is_killed(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time, urllib.request
        sys.path.insert(0, {str(Path.cwd())!r})
        from rlray.envs.servers import ServerProcess, ServerSpec
        s = ServerProcess(ServerSpec("orphan", command=("python", {SCRIPT!r}, "--host", "{{host}}", "--port", "{{port}}")),
                          {str(tmp_path)!r})
        url = s.start()
        print(urllib.request.urlopen(url + "/pid").read().decode(), flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        os.kill(pid, 0)  # the server runs
        parent.kill()  # SIGKILL: no atexit, no cleanup in the parent
        parent.wait()
        assert wait_gone(pid), "the server outlived the process that started it"
    finally:
        parent.kill()


def test_a_crashed_servers_leftover_worker_is_killed_with_its_group_at_restart_and_stop(tmp_path):
    """A server that dies (the OpenEnv crash test's os._exit) can leave a process it started running in its process
    group: seen as uvicorn processes alive long after their runs. The restart and stop kill the group even when the
    guard already exited."""
    server = ServerProcess(spec("crashy", "--child"), str(tmp_path))
    url = server.start()
    first_child = int(get(url + "/child"))
    os.kill(int(get(url + "/pid")), signal.SIGKILL)  # the server dies; its child lives on in the group
    assert wait_dead(server)
    os.kill(first_child, 0)  # still running: nothing has killed the group yet
    assert server.check()  # the restart
    assert wait_gone(first_child), "the crashed server's child outlived the restart"
    second_child = int(get(server.url + "/child"))
    os.kill(int(get(server.url + "/pid")), signal.SIGKILL)
    assert wait_dead(server)
    server.stop()
    assert wait_gone(second_child), "the crashed server's child outlived stop()"


def test_the_server_stops_when_its_guard_is_killed(tmp_path):
    """Ray kills an actor's child processes with SIGKILL: a guard killed so cannot stop its server, so the kernel does
    (the server asked for SIGTERM at its parent's death, PR_SET_PDEATHSIG)."""
    server = ServerProcess(spec(), str(tmp_path))
    try:
        url = server.start()
        pid = int(get(url + "/pid"))
        os.kill(server.pid, signal.SIGKILL)  # the guard only
        assert wait_gone(pid), "the server outlived its killed guard"
    finally:
        server.stop()

