"""The import architecture of rlray, checked by parsing every module with ``ast`` (nothing is imported).

Every import counts: module-level, function-local and ``TYPE_CHECKING`` ones. ``from rlray.pkg import name``
resolves to the module ``rlray.pkg.name`` when that is a module file, else to the package ``rlray.pkg``.
A "package" below is the first name under ``rlray.`` (``rlray.learner.policy`` is in ``learner``).

The scripts of benchmarks/ and jobs/ are users of the library: they may import any public rlray name (``SCRIPTS``),
no rlray module imports them, and they import each other (by bare name: a script puts its own folder on sys.path)
without a cycle. No module of rlray/, benchmarks/ or jobs/ is over ``MAX_LINES`` lines.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_BASE = {"algos", "config", "schema", "cores", "sandbox", "hangs", "cache"}  # DESIGN.md lines 1-2
_PARTS = {"data", "models", "rollout", "envs", "reward", "learner", "checkpoint", "observe"}  # line 3
# DESIGN.md: checkpoint/ and observe/ are services on line 3, not building blocks: they may read the config.
SERVICES = {"checkpoint", "observe"}

ALLOWED: dict[str, set[str]] = {
    # Lines 1-3: no edge but those written here (same-package imports are always allowed).
    # the root package holds __version__ and installs the import hook of rlray.lean_imports (issue 39)
    "rlray": {"lean_imports"},
    "lean_imports": set(),  # transformers without scikit-learn at import: imports only the standard library
    "cache": set(),  # rlray's cache folder (converted models, MLflow store templates): the standard library only
    "algos": set(),  # pure torch math
    "config": {"algos"},  # algo.name validates against the algorithm registry (rlray.algos.registry)
    "schema": set(),
    "cores": set(),
    # child processes with limits: below envs and reward, which both isolate user code in it; hangs: a child writes
    # its stacks on a signal, taken before it is killed at its time limit (issue 42)
    "sandbox": {"hangs"},
    # the stacks of a stuck process and the action on a call past its deadline (issue 42): below rollout, envs and
    # reward, whose actors and replicas write their stacks on a signal and whose waiters (the fleet) report hangs
    "hangs": set(),
    "data": {"schema"},  # prompt and pair tables are built on the experience record's Arrow schema
    # schema: the value and reward heads read the model-input record (schema.ModelInputs); cache: converted models
    "models": {"schema", "cache"},
    # cores: pin the engine's threads; models: load the HF fallback engine; schema: rollouts become experience rows
    "rollout": {"cores", "models", "schema", "hangs"},
    # models: tool schemas need the tokenizer's chat template; sandbox: untrusted environments run in its child processes
    "envs": {"schema", "models", "sandbox", "hangs"},
    # models: a reward model is a loaded LM with a head; schema: scores read experience rows;
    # checkpoint: a reward model can load from a snapshot; sandbox: user reward functions run in its child processes;
    # rollout: a judge (generative reward model) samples its verdicts with a RolloutEngine (vLLM or hf), as the policy;
    # hangs: the reward and judge Serve replicas write their stacks on a signal (a request past its timeout is reported)
    "reward": {"models", "schema", "checkpoint", "sandbox", "rollout", "hangs"},
    # learner applies the math of algos to the models it loads; schema: it trains on the experience record's
    # tensor form (schema.StepBatch, schema.ModelInputs)
    "learner": {"algos", "models", "schema"},
    # config: a snapshot stores the run's config; observe: lineage registers snapshots in MLflow via observe.tracking
    "checkpoint": {"config", "observe"},
    "observe": {"config", "cache"},  # params logged to MLflow are the flattened config; cache: the store template
    # Line 4: the run plan (issue 38), a validated config resolved once into typed records; below run/ and launch/,
    # above the building blocks whose plain records it holds (envs: MCP server specs; learner: the micro-batching;
    # models: the dtype; reward: term names; rollout: SamplingSpec).
    # observe: resolve_paths pins the MLflow store's sqlite path (observe.tracking_store.resolve_tracking_uri, deferred).
    "plan": {"config", "algos", "schema", "cores", "envs", "learner", "models", "reward", "rollout", "observe"},
    # Lines 5-8: anything on an earlier line (sweep: only what a sweep needs).
    "run": _BASE | _PARTS | {"plan"},
    "launch": _BASE | _PARTS | {"run", "plan"},
    "sweep": {"config", "checkpoint", "observe", "run", "launch", "plan"},
    # cli_parser: the argument parser of the rlray command, kept apart from the commands (rlray.cli) to stay short
    "cli_parser": {"rlray"},  # rlray: the root package's __version__ (--version)
    "cli": _BASE | _PARTS | {"run", "launch", "sweep", "plan", "cli_parser"},
}
# The script folders: users of the library, which may import any rlray package (its public names only).
SCRIPTS: dict[str, set[str]] = {"benchmarks": set(ALLOWED), "jobs": set(ALLOWED)}
MAX_LINES = 550  # the house's cap on a module (docs/architecture.md; STYLE.md aims at 400)
# Take plain values and never import rlray.config: line 3 less the services, and the plain packages of lines 1-2.
BUILDING_BLOCKS = {"algos", "data", "models", "rollout", "envs", "reward", "learner", "schema", "cores", "sandbox",
                   "hangs"}


def _modules() -> dict[str, Path]:
    """Returns {dotted module name: file} for every module under rlray/ (a package is its ``__init__.py``)."""
    out = {}
    for path in sorted((REPO / "rlray").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """Returns the longest prefix of dotted ``name`` that is an rlray module, or None (not rlray)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return None


@functools.cache
def _imports(path: Path) -> list[tuple[int, str, str]]:
    """Returns (line, imported rlray module, imported name or "") for every import in the file at ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = ".".join(path.relative_to(REPO).with_suffix("").parts)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, m, "") for a in node.names if (m := _resolve(a.name))]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: the file's package, then one part less per extra dot
                package = here.split(".")[:-1]
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                if m := _resolve(target):
                    out.append((node.lineno, m, "" if m == f"{base}.{a.name}" else a.name))
    return out


@functools.cache
def _graph() -> dict[str, list[tuple[int, str]]]:
    """Returns {module: [(line, imported module), ...]} over every rlray module."""
    return {mod: [(line, m) for line, m, _ in _imports(path)] for mod, path in MODULES.items()}


def _package(module: str) -> str:
    """Returns the package of a dotted module: "learner" for rlray.learner.policy, "cores" for rlray.cores."""
    return module.split(".")[1] if "." in module else module


def _where(module: str, line: int) -> str:
    """Returns "rlray/<path>.py:<line>" for a line of ``module``."""
    return f"{MODULES[module].relative_to(REPO)}:{line}"


def test_imports_follow_the_allowed_table():
    """Every import between packages is an edge of ALLOWED (an earlier line, or a peer edge written there)."""
    bad = []
    for mod, edges in _graph().items():
        src = _package(mod)
        if src not in ALLOWED:
            bad.append(f"{MODULES[mod].relative_to(REPO)}: package {src!r} is not in ALLOWED; add it")
            continue
        bad += [
            f"{_where(mod, line)}: {src} -> {_package(t)} ({t})"
            for line, t in edges
            if _package(t) != src and _package(t) not in ALLOWED[src]
        ]
    assert not bad, "imports not in ALLOWED:\n" + "\n".join(bad)


def _cycles(graph: dict[str, list[str]]) -> list[str]:
    """Returns each import cycle of ``graph`` ({module: [imported module, ...]}) found by a depth-first walk, as
    "a -> b -> a"."""
    cycles, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for t in graph[m]:
            if state.get(t) == "open":
                cycles.append(" -> ".join([*stack[stack.index(t) :], t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m)
    return cycles


def test_no_import_cycle():
    """No cycle between modules (function-local imports count: a deferred import hides a cycle, it does not break it)."""
    graph = {m: sorted({t for _, t in edges if t != m}) for m, edges in _graph().items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_table_gives_building_blocks_no_config_edge_and_services_one():
    """DESIGN.md: every line-3 package is a building block or a service (checkpoint/, observe/), never both; a
    building block has no edge to config in ALLOWED, a service may read the config."""
    assert not SERVICES & BUILDING_BLOCKS, "checkpoint/ and observe/ are services, not building blocks"
    assert _PARTS - SERVICES <= BUILDING_BLOCKS, "a line-3 package that is not a service is a building block"
    assert [b for b in sorted(BUILDING_BLOCKS) if "config" in ALLOWED[b]] == []
    assert all("config" in ALLOWED[s] for s in SERVICES)


def test_building_blocks_do_not_import_config():
    """Building blocks take plain values; run/ and launch/ turn the config into them (DESIGN.md, line 3; the
    services checkpoint/ and observe/ may read it)."""
    bad = [
        f"{_where(mod, line)}: {_package(mod)} imports {t}; take plain values and let rlray.run/rlray.launch read the config"
        for mod, edges in _graph().items()
        if _package(mod) in BUILDING_BLOCKS
        for line, t in edges
        if _package(t) == "config"
    ]
    assert not bad, "building blocks importing rlray.config:\n" + "\n".join(bad)


def _only_reexports(path: Path) -> bool:
    """Returns True when the file holds only a docstring, imports and dunder assignments (``__all__``)."""
    for stmt in ast.parse(path.read_text()).body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            continue
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) and t.id.startswith("__") for t in stmt.targets):
            continue
        return False
    return True


def test_every_module_is_imported_by_a_test():
    """Every module is imported by some file under tests/: itself, or a name that its package re-exports from it."""
    reexported = {  # (package, name) -> the module that defines the name
        (mod, name): t for mod, path in MODULES.items() if path.name == "__init__.py" for _, t, name in _imports(path) if name
    }
    tested = set()
    for path in (REPO / "tests").rglob("*.py"):
        for _, m, name in _imports(path):
            tested.add(m)
            tested.add(reexported.get((m, name), m))
    untested = [
        str(path.relative_to(REPO))
        for mod, path in MODULES.items()
        if mod not in tested and path.name != "__main__.py" and not (path.name == "__init__.py" and _only_reexports(path))
    ]
    assert not untested, "modules that no test imports:\n" + "\n".join(untested)


# --------------------------------------------------------------------------------------------
# benchmarks/ and jobs/, and the size of every module
# --------------------------------------------------------------------------------------------
SCRIPT_FILES = {f"{folder}.{p.stem}": p for folder in SCRIPTS for p in sorted((REPO / folder).glob("*.py"))}


@functools.cache
def _absolute_imports(path: Path) -> list[tuple[int, str, str]]:
    """Returns (line, module, imported name or "") for every absolute import in the file at ``path`` (``import a.b``
    gives ("a.b", ""), ``from a.b import c`` gives ("a.b", "c") per name); relative imports are left out."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out += [(node.lineno, node.module, a.name) for a in node.names]
    return out


def _script_target(path: Path, module: str) -> str | None:
    """Returns the script module ("benchmarks.benchlib") that ``module``, imported by the file at ``path``, names:
    ``benchmarks.x`` / ``jobs.x``, or a bare ``x`` with an x.py beside the importing file; else None."""
    top, _, rest = module.partition(".")
    if top in SCRIPTS and f"{top}.{rest.split('.')[0]}" in SCRIPT_FILES:
        return f"{top}.{rest.split('.')[0]}"
    return f"{path.parent.name}.{top}" if (path.parent / f"{top}.py").is_file() and path.parent.name in SCRIPTS else None


def test_scripts_import_public_rlray_names_of_the_allowed_packages():
    """benchmarks/ and jobs/ use rlray as a user does: any package of SCRIPTS[folder], never a name or a module
    whose name starts with an underscore (a private helper may change without notice)."""
    bad = []
    for script, path in SCRIPT_FILES.items():
        for line, module, name in _absolute_imports(path):
            parts = module.split(".")
            if parts[0] != "rlray":
                continue
            where = f"{path.relative_to(REPO)}:{line}"
            package = parts[1] if len(parts) > 1 else (name if f"rlray.{name}" in MODULES else "rlray")
            if package not in SCRIPTS[script.split(".")[0]]:
                bad.append(f"{where}: {module} (package {package!r} is not in SCRIPTS)")
            private = [p for p in [*parts, name] if p.startswith("_") and not (p.startswith("__") and p.endswith("__"))]
            if private:
                bad.append(f"{where}: from {module} import {name or '...'} (private: {', '.join(private)}); "
                           "use a public name or make the helper public")
    assert not bad, "script imports of rlray not allowed:\n" + "\n".join(bad)


def test_no_rlray_module_imports_a_script():
    """The library never imports its users: no rlray module imports the package benchmarks or jobs."""
    bad = [
        f"{_where(mod, line)}: imports {module}"
        for mod, path in MODULES.items()
        for line, module, _ in _absolute_imports(path)
        if module.split(".")[0] in SCRIPTS
    ]
    assert not bad, "rlray modules importing benchmarks/ or jobs/:\n" + "\n".join(bad)


def _script_graph() -> dict[str, list[str]]:
    """Returns {script module: sorted script modules it imports} over benchmarks/ and jobs/."""
    return {
        script: sorted({t for _, m, _ in _absolute_imports(path) if (t := _script_target(path, m)) and t != script})
        for script, path in SCRIPT_FILES.items()
    }


def test_no_import_cycle_among_the_scripts():
    """No cycle among benchmarks/ and jobs/ modules (deferred imports count, as in rlray/): a shared helper goes in a
    module both import (benchlib.py, gpu_probes.py, grpo_tables.py), not in one of the two."""
    graph = _script_graph()
    assert graph["benchmarks.gpu_check"] == ["benchmarks.gpu_fsdp", "benchmarks.gpu_probes"]  # the resolver sees them
    cycles = _cycles(graph)
    assert not cycles, "import cycles among the scripts:\n" + "\n".join(cycles)


def test_the_cycle_check_finds_a_deferred_cycle(tmp_path):
    """The check's own test: two scripts importing each other, one of them inside a function, are one cycle."""
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "a.py").write_text("import b\n")
    (folder / "b.py").write_text("def f():\n    from a import g\n")
    graph = {f"benchmarks.{n}": sorted({t for _, m, _ in _absolute_imports(folder / f"{n}.py")
                                        if (t := _script_target(folder / f"{n}.py", m))}) for n in "ab"}
    assert graph == {"benchmarks.a": ["benchmarks.b"], "benchmarks.b": ["benchmarks.a"]}
    assert _cycles(graph) == ["benchmarks.a -> benchmarks.b -> benchmarks.a"]


def test_no_module_is_over_the_line_cap():
    """Every module of rlray/, benchmarks/ and jobs/ has at most MAX_LINES lines: split it by responsibility."""
    files = [*MODULES.values(), *SCRIPT_FILES.values()]
    assert len(files) > 150
    over = [f"{p.relative_to(REPO)}: {n} lines" for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not over, f"modules over {MAX_LINES} lines:\n" + "\n".join(over)


# Readers of rlray.config by right: the config itself, the plan that resolves it, the CLI that loads it and the sweep
# code that edits it. Every other module should take the plan (rlray.plan.RunPlan) or plain values.
CONFIG_READERS = ("rlray.config", "rlray.plan", "rlray.cli", "rlray.sweep")


def _reads_config(module: str) -> bool:
    return any(_package(t) == "config" for _, t in _graph()[module])


def test_only_the_plan_the_cli_and_the_sweep_read_the_config():
    """Issue 38: outside rlray/config/, rlray/plan/, rlray/cli.py and rlray/sweep/ no module imports rlray.config: the
    run reads the plan (its settings typed ``rlray.plan.settings.Settings``), the services checkpoint/ and observe/
    take plain values (the CLI turns the config into them)."""
    own = lambda m: any(m == r or m.startswith(r + ".") for r in CONFIG_READERS)  # noqa: E731
    new = [f"{MODULES[m].relative_to(REPO)}" for m in MODULES if not own(m) and _reads_config(m)]
    assert not new, "modules importing rlray.config; take the run plan (rlray.plan) or plain values:\n" + "\n".join(new)
