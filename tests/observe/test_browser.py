"""The monitor's live page in a real browser (issue 13): Debian's chromium, headless, driven by selenium through
chromedriver with both paths given explicitly (selenium-manager never downloads anything).

The page is served from a RunMonitor filled with a 30-step fake run (tests/fixtures/page_demo.py; no Ray). The
browser must draw every chart's curves from /api/metrics and the sample viewer's rows from /api/samples, and a
screenshot of the reward chart must hold the curve's own colour, not only the chart's white background.

The browser comes from tests/observe/conftest.py (skipped without chromium unless CI is set). The real run's page is
checked by tests/observe/test_held_run.py; this fake run covers what a tiny run does not show: 30 steps, reward terms,
the KL guard's line, every timing stage, markup in a completion, a multi-turn episode and the step selector.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import page_demo as demo  # noqa: E402


@pytest.fixture
def served_demo():
    monitor = demo.demo_monitor()
    port = monitor.serve("127.0.0.1", 0)
    yield monitor, port
    monitor.close()


def test_page_draws_curves_and_samples_in_chromium(browser, served_demo):
    from selenium.webdriver.common.by import By

    monitor, port = served_demo
    browser.get(f"http://127.0.0.1:{port}/")
    demo.wait_for_page(browser)

    assert browser.find_element(By.ID, "run-id").text == "3f9c2a7be41d4c0c9d7a"
    assert browser.find_element(By.ID, "step").text == "30"
    assert browser.find_element(By.ID, "snapshot").text == "step 30"
    charts = browser.find_elements(By.CSS_SELECTOR, "#charts .chart")
    titles = [c.find_element(By.TAG_NAME, "h2").text for c in charts]
    assert titles[0] == "Reward (mean, each term, eval)" and "KL to the reference (nats/token)" in titles
    # Every chart the demo logs has one polyline per series, each through all 30 steps (no NaN in the demo).
    reward = charts[0]
    lines = reward.find_elements(By.CSS_SELECTOR, "svg polyline")
    assert len(lines) == 3  # reward/mean, reward/gsm8k_correct, reward/gsm8k_format
    for line in lines:
        points = line.get_attribute("points").split()
        assert len(points) == 30 and all(len(p.split(",")) == 2 for p in points)
    kl = charts[titles.index("KL to the reference (nats/token)")]
    assert "guard 0.05" in kl.text  # the guard's threshold is drawn, labelled
    assert len(kl.find_elements(By.CSS_SELECTOR, "svg polyline")[0].get_attribute("points").split()) == 30
    timing = charts[titles.index("Step time by stage (s)")]
    assert len(timing.find_elements(By.CSS_SELECTOR, "svg polyline")) == 6  # rollout, reward, logprobs, update, sync, step

    rows = browser.find_elements(By.CSS_SELECTOR, "#sample-table tbody tr")
    assert len(rows) == 4
    rewards = [r.find_elements(By.TAG_NAME, "td")[0].text for r in rows]
    assert rewards == ["1", "1", "0.2", "failed"]  # sorted by reward, high to low, a failed one last
    # a sample without a reward says why, naming its source (issue 29)
    failure = rows[3].find_element(By.CSS_SELECTOR, ".failure")
    assert failure.text == "no reward: environment 'calc' (env_error): reset(**row) raised KeyError: 'a' (at calc_env.py:9)"
    assert "<b>48 * 2 = 96</b>" in rows[2].text  # markup in a completion shows as text
    episode = next(r for r in rows if "guess" in r.text)
    labels = [e.text for e in episode.find_elements(By.CSS_SELECTOR, ".seg-label")]
    assert labels == ["turn 1", "observation", "turn 2 \u00b7 env reward 1"]
    steps = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#sample-step option")]
    assert steps == ["latest", "step 30", "step 29"]

    # The reward chart's screenshot holds the first curve's colour, beyond the white plot area and grey grid.
    near, other = demo.coloured_pixels(reward.find_element(By.TAG_NAME, "svg").screenshot_as_png, demo.CURVE_RGB)
    assert near > 100, f"only {near} pixels of the curve colour in the reward chart"
    assert other > near
