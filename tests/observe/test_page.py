"""The monitor's live page (issue 13): its JSON endpoints give back what the learner reported (the same figures
MLflow logs), incrementally; kept samples by step, 404 for a step not kept; the page is self-contained (no
external URL), escapes sample text, and its script runs against the endpoints (node, with a stand-in DOM)."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rlray.observe import metrics, page
from rlray.observe.monitor import Alerter, RunMonitor
from rlray.observe.samples import StepSample
from rlray.observe.tracking import Tracker, get_run_metrics

XSS = "</div><script>alert('pwned')</script><img src=x onerror=alert(1)>"


def _get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


@pytest.fixture
def served():
    m = RunMonitor("run42", heartbeat_s=60.0, alerter=Alerter(["log"]), kl_limit=0.03, page_sample_steps=2)
    port = m.serve("127.0.0.1", 0)
    yield m, port
    m.close()


def _step_metrics(step: int) -> dict[str, float]:
    return {"reward/mean": 0.1 * step, "reward/std": 0.5, "reward/gsm8k_correct": 0.25 * step,
            "reward/gsm8k_correct_skipped": 1.0, "algo/kl": 0.01 * step, "learner/pg_loss": -0.02 * step,
            "rollout/response_tokens_mean": 40.0 + step, "rollout/truncated_rate": 0.125, "perf/tokens_per_s": 900.0,
            "timing/rollout_s": 1.5, "timing/update_s": 2.5, "timing/step_s": 4.25, "data/epoch": 0.0,
            "algo/entropy": math.nan}


def _sample(step: int, completion: str = "4</s>", reward: float = 1.0) -> StepSample:
    return StepSample(step, f"p{step}", "<|im_start|>user\nWhat is 2+2?", completion, reward,
                      {"gsm8k_correct": reward, "gsm8k_format": None}, 0.5, "stop", step - 1, 3)


def test_metrics_endpoint_gives_what_mlflow_logged_and_only_newer_steps(served, tmp_path):
    monitor, port = served
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "page")
    for step in (1, 2, 3):  # rank 0's record(): the same dict goes to MLflow and to the monitor
        tracker.log_metrics(_step_metrics(step), step=step)
        monitor.record_step(step, 0, step, _step_metrics(step))
    status, headers, body = _get(port, "/api/metrics")
    doc = json.loads(body)
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert (doc["run_id"], doc["kl_limit"], doc["history_id"]) == ("run42", 0.03, 0)
    assert [p["step"] for p in doc["points"]] == [1, 2, 3]
    plotted = set(doc["points"][0]["values"])
    assert plotted == {"reward/mean", "reward/gsm8k_correct", "algo/kl", "learner/pg_loss", "rollout/response_tokens_mean",
                       "rollout/truncated_rate", "perf/tokens_per_s", "timing/rollout_s", "timing/update_s", "timing/step_s",
                       "algo/entropy"}  # only what the page plots: no reward/std, skipped counts or data/epoch
    logged = get_run_metrics(tracker.uri, tracker.run_id)
    for key in plotted - {"algo/entropy"}:
        assert [(p["step"], p["values"][key]) for p in doc["points"]] == logged[key], key
    assert doc["points"][0]["values"]["algo/entropy"] is None  # NaN is null: the page's JSON.parse takes it
    newer = json.loads(_get(port, "/api/metrics?since=2")[2])
    assert [p["step"] for p in newer["points"]] == [3] and newer["points"][0] == doc["points"][2]
    assert json.loads(_get(port, "/api/metrics?since=3")[2])["points"] == []
    status, _, body = _get(port, "/api/metrics?since=two")
    assert status == 400 and "since='two' is not a step number" in json.loads(body)["error"]
    tracker.finish()


def test_steps_run_again_replace_the_later_ones_and_change_the_history_id(served):
    monitor, port = served
    for step in (1, 2, 3, 4):
        monitor.record_step(step, 0, step, _step_metrics(step))
    monitor.record_step(3, 0, 3, {"reward/mean": 9.0})  # a rollback to the snapshot of step 2 runs step 3 again
    doc = json.loads(_get(port, "/api/metrics?since=0")[2])
    assert doc["history_id"] == 1 and [p["step"] for p in doc["points"]] == [1, 2, 3]
    assert doc["points"][-1]["values"] == {"reward/mean": 9.0}


def test_samples_endpoint_keeps_the_last_steps_and_404s_the_rest(served):
    monitor, port = served
    doc = json.loads(_get(port, "/api/samples")[2])
    assert doc == {"step": None, "steps": [], "samples": []}
    for step in (1, 2, 3):  # page_sample_steps=2: step 1 is dropped
        monitor.record_samples(step, [_sample(step), _sample(step, "nope", math.nan)])
    doc = json.loads(_get(port, "/api/samples")[2])
    assert (doc["step"], doc["steps"]) == (3, [2, 3])
    assert doc["samples"][0] == {"step": 3, "prompt_id": "p3", "prompt": "<|im_start|>user\nWhat is 2+2?", "completion": "4</s>",
                                 "reward": 1.0, "terms": {"gsm8k_correct": 1.0, "gsm8k_format": None}, "advantage": 0.5,
                                 "finish_reason": "stop", "policy_version": 2, "response_tokens": 3,
                                 "stop_reason": None, "num_turns": None, "turn_rewards": None, "segments": [],
                                 "segment": None, "failure": None, "judge_outputs": {}, "version_parts": []}
    assert doc["samples"][1]["reward"] is None and doc["samples"][1]["terms"]["gsm8k_correct"] == "failed"
    assert json.loads(_get(port, "/api/samples?step=2")[2])["samples"][0]["prompt_id"] == "p2"
    status, headers, body = _get(port, "/api/samples?step=1")
    err = json.loads(body)
    assert status == 404 and headers["Content-Type"] == "application/json"
    assert "no samples kept for step 1" in err["error"] and "[2, 3]" in err["error"] and "samples/step_000001.json" in err["error"]
    assert err["steps"] == [2, 3]
    assert _get(port, "/api/samples?step=x")[0] == 400


def test_sample_text_is_data_in_the_json(served):
    """A completion holding markup comes back escaped in the JSON (no '<', '>' or '&' in the body), served as
    application/json with nosniff; parsed, it is the exact text; the page puts it in the DOM as text (next tests)."""
    monitor, port = served
    monitor.record_samples(1, [_sample(1, XSS)])
    status, headers, body = _get(port, "/api/samples?step=1")
    assert (headers["Content-Type"], headers["X-Content-Type-Options"]) == ("application/json", "nosniff")
    assert b"<" not in body and b">" not in body and b"&" not in body  # escaped: \u003cscript\u003e
    assert b"\\u003cscript\\u003e" in body
    assert json.loads(body)["samples"][0]["completion"] == XSS  # the exact text comes back


def test_page_is_self_contained_and_builds_the_dom_with_text_only(served):
    monitor, port = served
    status, headers, html = _get(port, "/")
    html = html.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert '<script src="/static/monitor.js"></script>' in html
    assert "http://" not in html and "https://" not in html  # no CDN, nothing from the internet
    assert "script-src 'self'" in headers["Content-Security-Policy"]  # no inline or foreign script runs
    status, headers, js = _get(port, "/static/monitor.js")
    js = js.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    assert "innerHTML" not in js.replace("never innerHTML", "") and "insertAdjacentHTML" not in js
    assert "document.write" not in js and "eval(" not in js
    assert "textContent" in js
    urls = re.findall(r"https?://[^\s\"'`]+", js)
    assert urls == ["http://www.w3.org/2000/svg"]  # the SVG namespace name only, never fetched
    assert re.findall(r"fetch\(([^,)]+)", js) == ["url"] and re.findall(r"getJSON\(([`\"][^`\"]*)", js)
    assert all(u.strip("`\"").startswith("/") for u in re.findall(r"getJSON\(([`\"][^`\"]*)", js))  # the monitor's own paths
    assert _get(port, "/static/other.js")[0] == 404


def test_health_has_the_status_facts_the_page_shows(served):
    monitor, port = served
    monitor.record_step(4, 1, 4, _step_metrics(4))
    monitor.record_snapshot(4)
    monitor.alert("guard_trip", "kl_guard: KL 0.05 > 0.03; stopping", 4)
    health = json.loads(_get(port, "/health")[2])
    assert (health["step"], health["epoch"], health["policy_version"], health["snapshot_step"]) == (4, 1, 4, 4)
    assert [(a["kind"], a["step"], a["message"]) for a in health["alerts"]] == [("guard_trip", 4, "kl_guard: KL 0.05 > 0.03; stopping")]


def test_is_charted():
    assert metrics.is_charted("reward/mean") and metrics.is_charted("reward/my_term") and metrics.is_charted("timing/update_s")
    assert metrics.is_charted("reward/overlong")  # DAPO's own term is plotted with the others
    assert not metrics.is_charted("reward/my_term_skipped") and not metrics.is_charted("reward/std")
    assert not metrics.is_charted("monitor/rss_gib") and not metrics.is_charted("data/epoch")
    assert not metrics.is_charted("reward/overlong_penalty_mean")  # a registered reward/ key is no term


def _walk(node):
    yield node
    for child in node["children"]:
        yield from _walk(child)


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script (no browser here)")
def test_page_script_draws_the_curves_and_shows_markup_as_text(served, tmp_path):
    """The page's script, run by node against the monitor's real answers and a stand-in DOM that refuses
    innerHTML: it fills the status bar, draws every chart (the KL chart with the guard line), lists the samples
    with a completion holding <script> as plain text, sorts by reward, and switches to an earlier step."""
    monitor, port = served
    for step in (1, 2, 3):
        monitor.record_step(step, 0, step, _step_metrics(step))
    monitor.record_samples(2, [_sample(2)])
    monitor.record_samples(3, [_sample(3, XSS, 0.0), _sample(3, "8</s>", 1.0), _sample(3, "x", math.nan)])
    monitor.record_snapshot(3)
    urls = ["/health", "/api/charts", "/api/metrics?since=0", "/api/samples", "/api/samples?step=2"]
    responses = {u: {"status": 200, "body": _get(port, u)[2].decode()} for u in urls}
    monitor.record_step(4, 0, 4, _step_metrics(4))  # the next poll asks for the steps after 3 only
    responses["/api/metrics?since=3"] = {"status": 200, "body": _get(port, "/api/metrics?since=3")[2].decode()}
    html = _get(port, "/")[2].decode()
    ids = re.findall(r'id="([^"]+)"', html)
    events = [["th:reward", "click", None], ["sample-step", "change", "2"], [None, "tick", None]]
    out = subprocess.run(["node", str(Path(__file__).parents[1] / "fixtures" / "page_dom.js"), str(page.PAGE_DIR / "monitor.js"),
                          json.dumps(ids), json.dumps(responses), json.dumps(events)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["warnings"] == []
    first, by_reward_up, step2, polled = (snap["dom"] for snap in got["snapshots"])
    assert first["step"]["text"] == "3" and first["snapshot"]["text"] == "step 3" and first["run-id"]["text"] == "run42"
    charts = first["charts"]["children"]
    assert len(charts) == 9
    titles = [c["children"][0]["text"] for c in charts]
    kl = charts[titles.index("KL to the reference (nats/token)")]
    kl_svg = [n for n in _walk(kl) if n["tag"] == "svg"][0]
    assert any(n["tag"] == "line" and n["attrs"].get("stroke") == "#dc2626" for n in _walk(kl_svg))  # the guard
    assert any(n["text"] == "guard 0.03" for n in _walk(kl_svg))
    reward = charts[titles.index("Reward (mean, each term, eval)")]
    assert sum(n["tag"] == "polyline" for n in _walk(reward)) == 2  # reward/mean and the gsm8k_correct term
    legend = [n["text"] for n in _walk(reward) if n["tag"] == "#text"]
    assert legend == ["reward/mean 0.3", "reward/gsm8k_correct 0.75"]
    hints = [n["attrs"]["title"] for n in _walk(reward) if n["tag"] == "span" and "title" in n["attrs"]]
    charts_doc = metrics.charts_document()  # each legend entry says what its key holds, from the registry
    assert hints == [charts_doc["meanings"]["reward/mean"], charts_doc["term"]] and "(reward)" in hints[0]
    entropy = charts[titles.index("Entropy (nats/token)")]
    assert [n["text"] for n in _walk(entropy) if n["cls"] == "empty"] == ["not logged by this run"]  # NaN only
    rows = first["sample-table"]["children"][1]["children"]
    assert len(rows) == 3
    everything = [n for snap in (first, by_reward_up, step2) for root in snap.values() for n in _walk(root)]
    assert not any(n["tag"] in ("script", "img") for n in everything)  # no markup from the data became elements
    assert XSS in [n["text"] for n in _walk(first["sample-table"])]  # shown as text, character for character
    rewards = [r["children"][0]["text"] for r in rows]
    assert rewards == ["1", "0", "failed"]  # newest step, by reward high to low, the failed one last
    rows_up = by_reward_up["sample-table"]["children"][1]["children"]
    assert [r["children"][0]["text"] for r in rows_up] == ["0", "1", "failed"]
    assert [o["value"] for o in first["sample-step"]["children"]] == ["latest", "3", "2"]
    rows2 = step2["sample-table"]["children"][1]["children"]
    assert len(rows2) == 1 and rows2[0]["children"][-1]["children"][0]["text"] == "4</s>"
    assert "/api/samples?step=2" in got["fetched"] and got["fetched"].count("/api/charts") == 1  # read once
    assert got["fetched"].count("/api/metrics?since=0") == 1 and "/api/metrics?since=3" in got["fetched"]
    reward = polled["charts"]["children"][0]
    assert [n["text"] for n in _walk(reward) if n["tag"] == "#text"] == ["reward/mean 0.4", "reward/gsm8k_correct 1"]


# ---- healthy bands (monitor.bands) -------------------------------------------------------------
def test_least_squares_slope_and_outside_band():
    # x = 1, 2, 3 (mean 2), y = 1.0, 0.5, 0.0 (mean 0.5): sum dx*dy = (-1)(0.5) + 0 + (1)(-0.5) = -1; sum dx^2 = 2
    assert page.least_squares_slope([(1, 1.0), (2, 0.5), (3, 0.0)]) == -0.5
    assert page.least_squares_slope([(2, 3.0), (4, 3.0)]) == 0.0
    with pytest.raises(ValueError, match="2 distinct steps"):
        page.least_squares_slope([(5, 1.0)])
    loss = page.Band("learner/pg_loss", low=0.1, high=0.5)
    assert page.outside_band(loss, 0.3, []) is None
    assert page.outside_band(loss, 0.05, []) == "learner/pg_loss 0.05 < 0.1"
    assert page.outside_band(loss, 0.75, []) == "learner/pg_loss 0.75 > 0.5"
    assert page.outside_band(loss, math.nan, []) == "learner/pg_loss is nan"
    assert page.outside_band(page.Band("x/y", finite=False), math.inf, []) is None
    rising = page.Band("reward/mean", min_slope=0.0, window=3)
    assert page.outside_band(rising, 0.0, [(1, 1.0), (2, 0.5), (3, 0.0)]) == "reward/mean slope -0.5/step over 3 steps < 0"
    assert page.outside_band(rising, 0.0, [(2, 0.5), (3, 0.0)]) is None  # fewer than window values: no fit yet
    assert page.outside_band(rising, 2.0, [(1, 1.0), (2, 0.5), (3, 2.0)]) is None  # slope +0.5


def test_points_name_the_bands_they_leave():
    """The KL guard is a band; NaN losses, and reward falling over the window, mark their steps."""
    monitor = RunMonitor("r", heartbeat_s=60.0, alerter=Alerter(["log"]), kl_limit=0.03,
                         bands=(page.Band("learner/pg_loss"), page.Band("reward/mean", min_slope=0.0, window=3)))
    rows = [(1, 0.02, 0.1, 0.9), (2, 0.05, math.nan, 0.8), (3, 0.01, 0.2, 0.7), (4, 0.01, 0.2, 0.9)]
    for step, kl, loss, reward in rows:
        monitor.record_step(step, 0, step, {"algo/kl": kl, "learner/pg_loss": loss, "reward/mean": reward})
    doc = monitor.page.metrics_since(0)
    assert doc["bands"] == [
        {"metric": "learner/pg_loss", "low": None, "high": None, "finite": True, "min_slope": None, "window": 20},
        {"metric": "reward/mean", "low": None, "high": None, "finite": True, "min_slope": 0.0, "window": 3},
        {"metric": "algo/kl", "low": None, "high": 0.03, "finite": True, "min_slope": None, "window": 20}]
    outside = [p["outside"] for p in doc["points"]]
    assert outside[0] == {}
    assert outside[1] == {"algo/kl": "algo/kl 0.05 > 0.03", "learner/pg_loss": "learner/pg_loss is nan"}
    # step 3: rewards 0.9, 0.8, 0.7 at steps 1-3 fall by 0.1 per step
    assert outside[2] == {"reward/mean": "reward/mean slope -0.1/step over 3 steps < 0"}
    assert outside[3] == {}  # 0.8, 0.7, 0.9 at steps 2-4: slope +0.05
    monitor.close()


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script (no browser here)")
def test_page_script_shades_bands_and_marks_steps_outside(tmp_path):
    monitor = RunMonitor("r", heartbeat_s=60.0, alerter=Alerter(["log"]), kl_limit=0.03,
                         bands=(page.Band("learner/pg_loss", low=0.1, high=0.5),))
    port = monitor.serve("127.0.0.1", 0)
    try:
        for step, kl, loss in [(1, 0.01, 0.2), (2, 0.05, 0.3), (3, 0.02, math.nan)]:
            monitor.record_step(step, 0, step, {"algo/kl": kl, "learner/pg_loss": loss})
        urls = ["/health", "/api/charts", "/api/metrics?since=0", "/api/samples"]
        responses = {u: {"status": 200, "body": _get(port, u)[2].decode()} for u in urls}
        ids = re.findall(r'id="([^"]+)"', _get(port, "/")[2].decode())
        out = subprocess.run(["node", str(Path(__file__).parents[1] / "fixtures" / "page_dom.js"), str(page.PAGE_DIR / "monitor.js"),
                              json.dumps(ids), json.dumps(responses), "[]"], capture_output=True, text=True, timeout=60, check=False)
    finally:
        monitor.close()
    assert out.returncode == 0, out.stderr
    charts = json.loads(out.stdout)["snapshots"][0]["dom"]["charts"]["children"]
    by_title = {c["children"][0]["text"]: c for c in charts}
    kl, loss = by_title["KL to the reference (nats/token)"], by_title["Policy loss"]
    assert sum(n.get("attrs", {}).get("class") == "band" for n in _walk(kl)) == 1  # 0 .. guard threshold, shaded
    kl_markers = [n for n in _walk(kl) if n.get("attrs", {}).get("class") == "band-marker"]
    assert [m["children"][0]["text"] for m in kl_markers] == ["step 2: algo/kl 0.05 > 0.03"]
    loss_markers = [n for n in _walk(loss) if n.get("attrs", {}).get("class") == "band-marker"]
    assert [m["children"][0]["text"] for m in loss_markers] == ["step 3: learner/pg_loss is nan"]
    assert [n["text"] for n in _walk(loss) if n.get("cls") == "band-note"] == [
        "outside its band at 1 step(s); last: step 3: learner/pg_loss is nan"]
    assert sum(n.get("attrs", {}).get("class") == "band" for n in _walk(loss)) == 1


def _sample_table(monitor, port: int, step: int, samples: list[StepSample]) -> dict:
    """Records ``samples`` as step ``step``'s and returns the sample table's DOM as the page's script builds it from
    the served responses (node, tests/fixtures/page_dom.js)."""
    monitor.record_samples(step, samples)
    responses = {u: {"status": 200, "body": _get(port, u)[2].decode()} for u in ["/health", "/api/charts", "/api/metrics?since=0", "/api/samples"]}
    ids = re.findall(r'id="([^"]+)"', _get(port, "/")[2].decode())
    out = subprocess.run(["node", str(Path(__file__).parents[1] / "fixtures" / "page_dom.js"), str(page.PAGE_DIR / "monitor.js"),
                          json.dumps(ids), json.dumps(responses), "[]"], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["snapshots"][0]["dom"]["sample-table"]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script (no browser here)")
def test_page_script_shows_an_episode_turn_by_turn(served):
    """An episode's turns and observations are set apart (an observation holding markup stays text), each turn with
    the environment's reward after it; its stop reason and turns show; a single-turn row keeps one text, with its
    judge's raw output (markup too) under it."""
    monitor, port = served
    episode = StepSample(1, "g", "guess a number", "<a>5</a><obs>higher</obs><a>7</a>", 1.0, {"env": 1.0}, 0.5, "stop", 0, 9,
                         "done", 2, (None, 1.0), ((True, "<a>5</a>"), (False, XSS), (True, "<a>7</a>")))
    single = StepSample(1, "q", "2+2?", "4", 0.0, {"env": 0.0}, -0.5, "stop", 0, 1, judge_outputs={"judge": XSS})
    table = _sample_table(monitor, port, 1, [episode, single])
    head = [th["text"] for th in table["children"][0]["children"][0]["children"]]
    assert head[3:6] == ["stop reason", "turns", "tokens"]
    ep_row, single_row = table["children"][1]["children"]  # by reward, high to low
    assert [c["text"] for c in ep_row["children"][3:5]] == ["done", "2"]
    assert [c["text"] for c in single_row["children"][3:5]] == ["stop", "-"]
    segments = ep_row["children"][-1]["children"][0]["children"]
    assert [seg["cls"] for seg in segments] == ["seg seg-assistant", "seg seg-observation", "seg seg-assistant"]
    assert [(seg["children"][0]["text"], seg["children"][1]["text"]) for seg in segments] == [
        ("turn 1", "<a>5</a>"), ("observation", XSS), ("turn 2 \u00b7 env reward 1", "<a>7</a>")]
    assert not any(n["tag"] in ("script", "img") for n in _walk(table))
    assert single_row["children"][-1]["children"][0]["text"] == "4"
    judged = single_row["children"][-1]["children"][1]  # the judge's raw output under the completion, as text
    assert judged["cls"] == "seg seg-judge" and [c["text"] for c in judged["children"]] == ["judge judge", XSS]
    assert len(ep_row["children"][-1]["children"]) == 1  # no judge on the episode row: nothing under its turns


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script (no browser here)")
def test_page_script_marks_a_segment_of_an_agent_episode(served):
    """A row that holds one segment of an agent episode cut where the agent rewrote its history says which segment it
    is, above its turns; an uncut episode has no such line."""
    monitor, port = served
    cut = StepSample(2, "w", "spell", "<a>5</a>", 1.0, {"env": 1.0}, 0.5, "stop", 0, 3, "template_drift", 1, (None,),
                     ((True, "<a>5</a>"),), segment=1)
    whole = StepSample(2, "v", "spell", "<a>6</a>", 0.0, {"env": 0.0}, -0.5, "stop", 0, 3, "done", 1, (0.0,),
                       ((True, "<a>6</a>"),))
    table = _sample_table(monitor, port, 2, [cut, whole])
    cut_row, whole_row = table["children"][1]["children"]  # by reward, high to low
    first = cut_row["children"][-1]["children"][0]["children"][0]
    assert first["cls"] == "seg-label" and first["text"].startswith("segment 2: the agent rewrote its history")
    assert [c["cls"] for c in whole_row["children"][-1]["children"][0]["children"]] == ["seg seg-assistant"]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script (no browser here)")
def test_page_script_marks_where_a_partial_rollout_changed_version(served):
    """A response sampled across two weight updates (rollout.partial) shows its parts in order with a marker before
    each new version (its title names the first token of that version), and its version column the range; a row of one
    version keeps one text and its version."""
    monitor, port = served
    partial = StepSample(3, "p", "2+2?", "four</s>", 1.0, {"env": 1.0}, 0.5, "stop", 0, 4,
                         version_parts=((0, 2, "fo"), (1, 1, XSS), (2, 1, "</s>")))
    plain = StepSample(3, "q", "2+2?", "4</s>", 0.0, {"env": 0.0}, -0.5, "stop", 2, 2)
    table = _sample_table(monitor, port, 3, [partial, plain])
    head = [th["text"] for th in table["children"][0]["children"][0]["children"]]
    partial_row, plain_row = table["children"][1]["children"]  # by reward, high to low
    version = head.index("policy version")
    assert (partial_row["children"][version]["text"], plain_row["children"][version]["text"]) == ("0\u21922", "2")
    parts = partial_row["children"][-1]["children"][0]["children"]
    assert [(n["cls"], n["text"]) for n in parts] == [("", "fo"), ("ver-mark", "v1"), ("", XSS), ("ver-mark", "v2"),
                                                      ("", "</s>")]
    assert [n["attrs"]["title"] for n in parts] == [
        "policy version 0: tokens 1-2", "weights updated during the generation: policy version 1 from token 3",
        "policy version 1: tokens 3-3", "weights updated during the generation: policy version 2 from token 4",
        "policy version 2: tokens 4-4"]
    assert not any(n["tag"] in ("script", "img") for n in _walk(table))
    assert plain_row["children"][-1]["children"][0]["text"] == "4</s>"
