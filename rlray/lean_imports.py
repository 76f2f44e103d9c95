"""transformers without scikit-learn at import: a process that loads a tokenizer or a model pays ~1.5-2.5 s less.

transformers' assisted-generation module (``transformers.generation.candidate_generator``) runs
``from sklearn.metrics import roc_curve`` at import whenever scikit-learn is installed (MLflow installs it), and
every ``AutoTokenizer``, ``AutoConfig`` and ``AutoModel*`` import reaches that module. The import costs 1.5-2.5 s
of CPU on the 2-core machines (``python -X importtime``: sklearn, scipy, pandas) in every process that touches
transformers: the driver, each learner rank, each rollout, reference and environment actor, every test
subprocess. rlray never runs assisted generation, the only user of ``roc_curve`` there.

``install()`` (called by ``import rlray``) adds an import hook that runs that one module with scikit-learn looking
absent, then restores transformers' real ``is_sklearn_available`` in it and gives it a ``roc_curve`` that imports
scikit-learn on its first call. Nothing is hidden: ``import sklearn`` works as before (a reward function may use
it), ``is_sklearn_available()`` answers the truth everywhere after the import, and assisted generation with
``assistant_confidence_threshold`` behaves as without the hook, one import later. Issue 39 (start-up).

Source: transformers 5.x ``generation/candidate_generator.py`` (module-level ``if is_sklearn_available(): from
sklearn.metrics import roc_curve``, its only scikit-learn use).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any

TARGET = "transformers.generation.candidate_generator"
_installed = threading.Lock()


def roc_curve(*args: Any, **kwargs: Any) -> Any:
    """``sklearn.metrics.roc_curve``, imported at its first call (see the module docstring). Raises what it raises."""
    from sklearn.metrics import roc_curve as real

    return real(*args, **kwargs)


class _Loader(importlib.abc.Loader):
    """Runs the wrapped loader's ``exec_module`` with ``transformers.utils.is_sklearn_available`` answering False."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        import transformers.utils as utils

        real = utils.is_sklearn_available
        utils.is_sklearn_available = lambda: False  # read once, by the module's `from ..utils import ...`
        try:
            self._inner.exec_module(module)
        finally:
            utils.is_sklearn_available = real
        module.is_sklearn_available = real  # its runtime checks (assisted generation) see the truth
        if real():
            module.roc_curve = roc_curve


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``TARGET`` through the rest of ``sys.meta_path`` and wraps its loader in ``_Loader``."""

    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> bool:
    """Adds the import hook once per process; returns True when it is in place (False: transformers' generation
    code was already imported, nothing to save)."""
    with _installed:
        if TARGET in sys.modules:
            return False
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
        return True
