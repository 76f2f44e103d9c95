"""Every ``from rlray... import name`` in the benchmark scripts, also the deferred ones inside functions that only a
long run reaches, names something that exists: a moved helper breaks this test, not a 30-minute `make bench`."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _rlray_imports(path: Path) -> list[tuple[int, str, str]]:
    """Returns (line, module, name) of each ``from rlray[.x] import name`` anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.lineno, node.module, alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "rlray"
            for alias in node.names]


def _missing(path: Path) -> list[str]:
    """Returns "file:line: module.name" for each rlray import of ``path`` whose name does not exist."""
    missing = []
    for line, module, name in _rlray_imports(path):
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ImportError:
                missing.append(f"{path.name}:{line}: {module}.{name}")
    return missing


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_the_rlray_names_a_benchmark_imports_exist(script):
    assert _missing(BENCH / script) == []


def test_a_moved_name_is_reported_with_its_line(tmp_path):
    # the import that broke rollout.py and weight_sync.py when split_cores moved to rlray.cores
    script = tmp_path / "old.py"
    script.write_text("import os\n\n\ndef f():\n    from rlray.launch.placement import split_cores\n"
                      "    from rlray.cores import split_cores as ok\n    from rlray import learner\n")
    assert _missing(script) == ["old.py:5: rlray.launch.placement.split_cores"]
