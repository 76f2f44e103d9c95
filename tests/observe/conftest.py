"""Fixtures of the observe tests: a headless chromium for the live page (tests/fixtures/page_demo.py's helpers).

Skipped, with the reason, where chromium, chromedriver or selenium is missing and the CI variable is unset; on CI
(``.ci/run`` installs both packages with apt-get) a missing browser fails the test instead.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import page_demo  # noqa: E402


def _missing() -> str | None:
    """Returns why the browser tests cannot run here, or None when they can."""
    if page_demo.browser_paths() is None:
        return "no chromium/chromedriver (apt-get install -y chromium chromium-driver)"
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (the dev extra: pip install -e '.[dev]')"
    return None


@pytest.fixture
def browser():
    """Returns a headless chromium WebDriver (``page_demo.headless_chromium``), quit after the test."""
    reason = _missing()
    if reason is not None and os.environ.get("RLRAY_SKIP_BROWSER") == "1":
        pytest.skip(f"RLRAY_SKIP_BROWSER=1: {reason}")  # opted out by hand, never by default
    if reason is not None:
        pytest.fail(f"the browser test cannot run: {reason}; `make browser` installs it (root or sudo), or set "
                    "RLRAY_SKIP_BROWSER=1 to skip the browser tests on purpose")
    b = page_demo.headless_chromium(*page_demo.browser_paths())
    yield b
    b.quit()
