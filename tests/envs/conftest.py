"""Fixtures for environment tests: the TRL-shaped calculator class of tests/fixtures/envs/trl_calculator.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TRL_CALCULATOR_FILE = Path(__file__).resolve().parents[1] / "fixtures" / "envs" / "trl_calculator.py"


@pytest.fixture(scope="session")
def trl_calculator_cls() -> type:
    """Returns the class TRLCalculatorEnv, loaded from its file (tests/ is not a package on sys.path)."""
    spec = importlib.util.spec_from_file_location("trl_calculator_fixture", TRL_CALCULATOR_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TRLCalculatorEnv
