"""The metric registry (issue 34): one list of keys with units and meanings, read by MLflow's consumers, the monitor's
gauges, the console and the page; every key a chart, a gauge or a progress field names is registered; the page's
script holds no key of its own (its charts come from /api/charts)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections import Counter

import pytest

from rlray.launch import console
from rlray.observe import metrics, monitor, page
from rlray.observe.monitor import Alerter, RunMonitor


def test_every_key_is_registered_once_with_a_unit_and_a_meaning():
    keys = [m.key for m in metrics.METRICS]
    assert [k for k, n in Counter(keys).items() if n > 1] == []
    for m in metrics.METRICS:
        assert re.fullmatch(r"[a-z]+/[a-z0-9_@]+", m.key), m.key
        assert m.unit.strip() and m.meaning.strip() and "\n" not in m.meaning, m.key
    assert set(metrics.METRIC_KEYS) | set(metrics.EVAL_KEYS) == set(keys)
    assert all(k.startswith("eval/") for k in metrics.EVAL_KEYS)
    assert not any(k.startswith("eval/") for k in metrics.METRIC_KEYS)
    assert {m.section for m in metrics.METRICS} == {"reward", "algo", "learner", "rollout", "data", "perf", "timing",
                                                     "guard", "run", "checkpoint", "monitor", "env", "eval"}
    for f in (*metrics.FAMILIES, *metrics.TERM_FAMILIES):
        assert f.pattern.count("{") == 1 and f.unit.strip() and f.meaning.strip(), f.pattern
    # no fixed key hides in an open family, and no family's prefix is another's
    prefixes = [f.prefix for f in metrics.FAMILIES]
    assert not [k for k in keys if k.startswith(tuple(prefixes))]
    assert not [(a, b) for a in prefixes for b in prefixes if a != b and a.startswith(b)]
    assert not set(metrics.RENAMED_KEYS) & set(keys) and set(metrics.RENAMED_KEYS.values()) <= set(
        metrics.term_keys(["gsm8k_correct", "gsm8k_format"]))


def test_keys_of_families_and_reward_terms():
    assert metrics.term_keys(["exact"]) == ("reward/exact", "reward/exact_skipped", "eval/exact", "eval/exact_skipped")
    assert metrics.is_metric_key("reward/mean") and metrics.is_metric_key("eval/env_success")
    assert metrics.is_metric_key("env/stop_reason/max_turns") and metrics.is_metric_key("eval/pass@4")
    assert metrics.is_metric_key("reward/exact", ["exact"]) and not metrics.is_metric_key("reward/exact")
    # DAPO's overlong shaping adds its own term (rlray.run.online_sampling.overlong_shaping): declared here
    assert metrics.is_metric_key("reward/overlong") and metrics.is_metric_key("reward/overlong_skipped")
    assert not metrics.is_metric_key("reward/whatever") and not metrics.is_metric_key("learner/nope")
    assert metrics.describe("env/stop_reason/done").unit == "count"
    assert metrics.describe("algo/kl") == metrics.BY_KEY["algo/kl"] and metrics.describe("algo/kl").section == "algo"
    with pytest.raises(KeyError, match="'learner/nope' is not in rlray.observe.metrics"):
        metrics.describe("learner/nope")
    assert metrics.is_term_mean("reward/exact") and not metrics.is_term_mean("reward/exact_skipped")
    assert not metrics.is_term_mean("reward/std") and not metrics.is_term_mean("algo/kl")


def test_charts_gauges_and_progress_fields_name_registered_keys():
    """Every key a consumer names is registered with a unit and a meaning; ``check_names`` (run at import) refuses a
    chart, gauge or field naming an unregistered key, or a key without a unit or meaning."""
    named = [k for c in metrics.CHARTS for k in c.keys] + [g.key for g in metrics.STEP_GAUGES]
    named += [f.key for f in metrics.PROGRESS_FIELDS]
    for key in named:
        m = metrics.BY_KEY[key]
        assert m.unit.strip() and m.meaning.strip(), key
    metrics.check_names(metrics.CHARTS, metrics.STEP_GAUGES, metrics.PROGRESS_FIELDS)
    bad = (metrics.Chart("Made up", "s", ("timing/nowhere_s",)),)
    with pytest.raises(ValueError, match="chart 'Made up' names 'timing/nowhere_s', which is not registered"):
        metrics.check_names(bad, (), ())
    with pytest.raises(ValueError, match="gauge rlray_x names 'reward/nope'"):
        metrics.check_names((), (metrics.StepGauge("rlray_x", "reward/nope", "x"),), ())
    with pytest.raises(ValueError, match="progress field 'r' names 'reward/nope'"):
        metrics.check_names((), (), (metrics.ProgressField("reward/nope", "r", "{}"),))
    saved = metrics.BY_KEY["algo/kl"]
    try:
        metrics.BY_KEY["algo/kl"] = metrics.Metric("algo/kl", "", "KL")
        with pytest.raises(ValueError, match="'algo/kl', which has no unit or meaning"):
            metrics.check_names(metrics.CHARTS, (), ())
    finally:
        metrics.BY_KEY["algo/kl"] = saved
    assert [c.title for c in metrics.CHARTS if c.reward_terms] == ["Reward (mean, each term, eval)"]
    assert [c.title for c in metrics.CHARTS if c.guard_line] == ["KL to the reference (nats/token)"]


def test_consumers_read_the_registry():
    """The monitor's gauges, the console's figures and the page's plotted keys are the registry's own."""
    for g in metrics.STEP_GAUGES:
        assert monitor.GAUGES[g.name] == g.help
    assert console.PROGRESS_FIELDS is metrics.PROGRESS_FIELDS
    assert console.progress_fields({"reward/mean": 0.5, "timing/step_s": 2.0, "reward/std": 1.0}, None) == "reward=0.500 step=2.0s"
    m = RunMonitor("r", heartbeat_s=60.0, alerter=Alerter(["log"]))
    try:
        m.record_step(1, 0, 1, {"reward/mean": 0.5, "algo/kl": 0.01, "perf/tokens_per_s": 10.0, "rollout/staleness_mean": 1.0,
                                "reward/std": 0.1})
        assert {g.name: m.metrics.value(g.name) for g in metrics.STEP_GAUGES} == {
            "rlray_reward_mean": 0.5, "rlray_kl": 0.01, "rlray_tokens_per_s": 10.0, "rlray_staleness": 1.0}
        assert set(m.page.metrics_since(0)["points"][0]["values"]) == {"reward/mean", "algo/kl", "perf/tokens_per_s"}
    finally:
        m.close()


def test_the_page_script_names_no_metric_key():
    """The page draws the charts it is given (/api/charts): its script holds no metric key or key prefix."""
    js = (page.PAGE_DIR / "monitor.js").read_text()
    sections = {m.section for m in metrics.METRICS}
    assert not [s for s in sections if f'"{s}/' in js or f"'{s}/" in js or f"`{s}/" in js]


def test_charts_document_is_served_by_the_live_page():
    m = RunMonitor("r", heartbeat_s=60.0, alerter=Alerter(["log"]), kl_limit=0.03)
    port = m.serve("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/charts", timeout=10) as r:
            doc = json.loads(r.read())
    finally:
        m.close()
    assert doc == json.loads(json.dumps(metrics.charts_document()))
    assert [c["title"] for c in doc["charts"]] == [c.title for c in metrics.CHARTS]
    assert doc["charts"][0] == {"title": "Reward (mean, each term, eval)", "unit": "reward",
                                "keys": ["reward/mean", "eval/reward_mean"], "reward_terms": True, "guard_line": False}
    assert doc["meanings"]["algo/kl"] == f"{metrics.BY_KEY['algo/kl'].meaning} (nats/token)"
    assert set(doc["meanings"]) == metrics.CHARTED_KEYS


def test_the_registry_imports_no_mlflow():
    code = "import sys, rlray.observe.metrics; print('mlflow' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "False"]
