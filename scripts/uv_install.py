"""Installs packages into a Python environment with uv, from pip's own sources; pip itself when uv fails.

    python scripts/uv_install.py .venv/bin/python -- -q -e ".[cpu,dev]"

``make install`` builds rlray's environment and the environment servers' with it: uv installs in parallel and from
its cache (rlray's environment in ~40 s on 2 cores where pip took ~5 min). Where packages come from stays pip's
choice: the indexes, find-links folders and constraints files of pip's configuration (files and ``PIP_*``
variables, as ``pip config list`` prints them) become uv's flags, and pip's ``cert`` becomes ``SSL_CERT_FILE``.
Like pip, uv then takes the best version over every index (``--index-strategy unsafe-best-match``).

uv writes each package's bytecode at install (``--compile-bytecode``, as pip does by default; uv's own default is not
to): a process then imports those modules from their ``.pyc`` instead of compiling their sources, which matters most
where Python may not write the cache itself (``PYTHONDONTWRITEBYTECODE`` set, a read-only environment): every Ray
worker of a run and every test process compiled transformers, vLLM and Ray's sources again at each start, ~8 s of a
SmolLM2 run's first step on 2 cores (issue 39).

When uv cannot be installed or its install fails (a source it cannot read, an option it lacks), the same
arguments go to ``pip install`` and the run says so: the result is the environment pip would have built.

Stdlib only: it runs before anything is installed. Tested in tests/test_install.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

# pip's options that name sources, as uv's flags; each may hold several space-separated values.
SOURCE_FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def parse_pip_config(text: str) -> dict[str, str]:
    """Returns pip's configuration as option name to value from ``pip config list``'s lines (``global.find-links='/x'``,
    ``:env:.find-links='/x'``); an environment variable wins over a file, a later file over an earlier one (pip's
    order). Lines that are not ``key='value'`` are skipped."""
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if not sep or len(value) < 2 or value[0] not in "'\"" or value[-1] != value[0]:
            continue
        section, _, name = key.rpartition(".")
        (env if section == ":env:" else files)[name] = value[1:-1]
    return files | env


def uv_args(config: dict[str, str]) -> list[str]:
    """Returns uv's flags for pip's source options in ``config`` (``parse_pip_config``), always with
    ``--index-strategy unsafe-best-match`` (pip's way: every index's versions compete). ``no-index`` true gives
    ``--no-index``."""
    args: list[str] = []
    for option, flag in SOURCE_FLAGS.items():
        for value in config.get(option, "").split():
            args += [flag, value]
    if config.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    return [*args, "--index-strategy", "unsafe-best-match"]


def uv_env(config: dict[str, str]) -> dict[str, str]:
    """Returns the environment for uv: this one, with pip's ``cert`` as ``SSL_CERT_FILE`` when pip names one."""
    env = dict(os.environ)
    if config.get("cert"):
        env.setdefault("SSL_CERT_FILE", config["cert"])
    return env


def install(python: str, packages: list[str]) -> int:
    """Installs ``packages`` (pip install's arguments) into ``python``'s environment with uv, else with pip; returns the
    exit status of the install that ran last."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True)
    config = parse_pip_config(listed.stdout)
    uv = os.path.join(os.path.dirname(python), "uv")
    got = subprocess.run([python, "-m", "pip", "install", "-q", "uv"], capture_output=True, text=True)
    if got.returncode == 0 and os.path.exists(uv):
        quiet = [p for p in packages if p in ("-q", "--quiet")]
        rest = [p for p in packages if p not in ("-q", "--quiet")]
        ran = subprocess.run([uv, "pip", "install", *quiet, "--python", python, "--compile-bytecode", *uv_args(config), *rest],
                             env=uv_env(config))
        if ran.returncode == 0:
            return 0
        print(f"uv_install: uv failed (exit {ran.returncode}); installing with pip instead", file=sys.stderr)
    else:
        print(f"uv_install: could not install uv ({got.stderr.strip()[-300:]}); installing with pip", file=sys.stderr)
    return subprocess.run([python, "-m", "pip", "install", *packages]).returncode


def main(argv: list[str]) -> int:
    """``uv_install.py PYTHON -- ARGS...``: see the module docstring."""
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python scripts/uv_install.py PYTHON -- PIP_INSTALL_ARGS...", file=sys.stderr)
        return 2
    return install(argv[0], argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
