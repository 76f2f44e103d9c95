"""OpenEnv test environments: the template `openenv init NAME` writes (an echo environment: the action's `message`
comes back as `echoed_message`, reward 0.1 * len(message), never done), generated with OpenEnv's own CLI
from the server's virtual environment (.venvs/openenv, built by `make install`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
OPENENV_VENV = REPO / ".venvs" / "openenv"


def openenv_venv() -> Path:
    """Returns .venvs/openenv (skips the test when `make install` has not built it)."""
    if not (OPENENV_VENV / "bin" / "openenv").exists():
        pytest.skip("no .venvs/openenv: `make install` (or `make openenv-venv`) builds the OpenEnv server's environment")
    return OPENENV_VENV


def openenv_init(folder: Path, name: str = "echo_env", sessions: int = 16) -> Path:
    """Returns the folder of a new environment written by `openenv init name` in ``folder``, its app allowing
    ``sessions`` concurrent WebSocket sessions (the template's max_concurrent_envs=1 is the line a user edits)."""
    venv = openenv_venv()
    subprocess.run([str(venv / "bin" / "openenv"), "init", name], cwd=folder, check=True, capture_output=True)
    app = folder / name / "server" / "app.py"
    text, n = re.subn(r"max_concurrent_envs=1\b", f"max_concurrent_envs={sessions}", app.read_text())
    assert n == 1, "the OpenEnv template changed: max_concurrent_envs=1 not found in server/app.py"
    app.write_text(text)
    return folder / name


def server_command() -> tuple[str, ...]:
    """Returns the command that serves a template environment from its folder, bound to rlray's host and port (the
    template's own `python -m server.app` binds 0.0.0.0; uvicorn, its documented production path, takes --host)."""
    return ("python", "-m", "uvicorn", "server.app:app", "--host", "{host}", "--port", "{port}")
