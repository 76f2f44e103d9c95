"""The monitor's live page: the figures it plots, the samples it shows, and its files.

``PageData`` keeps what the page needs as the learner reports it (``RunMonitor.record_step`` and
``record_samples``): the series of the keys the page plots (``metrics.is_charted``), appended once per step, and
the kept samples of the last ``sample_steps`` steps. A request reads a slice (``metrics_since``: only the
steps after the page's last one), so polling costs the new steps, never the whole history.

``PageServer`` is the one HTTP routing of the page, for the live monitor (``RunMonitor``) and for a run read back
from MLflow (``rlray.observe.stored.StoredRun``); each gives its own /health document and samples.

The page itself is two files in ``page/`` served as they are: ``index.html`` and ``monitor.js``, which
reads the chart definitions once from ``/api/charts`` (the metric registry's ``CHARTS``, as data), polls
``/api/metrics``, ``/api/samples`` and ``/health``, and draws the curves as inline SVG with its own
small functions (no CDN, no internet, no JavaScript package). Sample text reaches the page as JSON data and
is put into the DOM with ``textContent`` only; the page's Content-Security-Policy allows scripts from the
monitor's own origin alone, so text that holds ``<script>`` can never run.
"""

from __future__ import annotations

import abc
import bisect
import json
import math
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rlray.observe import metrics
from rlray.observe.samples import StepSample, json_row

PAGE_DIR = Path(__file__).with_name("page")
STATIC: dict[str, tuple[str, str]] = {  # URL path -> (file in PAGE_DIR, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/monitor.js": ("monitor.js", "text/javascript; charset=utf-8"),
}
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)

HEALTH_ALERTS = 5  # the newest alerts /health (and the page's status bar) lists


@dataclass(frozen=True)
class Alert:
    """One alert the monitor sent.

    Attributes:
        kind: guard_trip, restart, stall, snapshot_failed, ...
        message: what happened, for people.
        step: the run's step when it was sent; None where unknown (a stored run's alert tags keep no step).
        time: Unix seconds when it was sent; None where unknown.
    """

    kind: str
    message: str
    step: int | None
    time: float | None



def _json_number(value: float) -> float | None:
    """Returns ``value`` as a float, or None for NaN and infinities (JSON has neither)."""
    value = float(value)
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Band:
    """A healthy band of one plotted metric (``monitor.bands``; the KL guard's is ``Band("algo/kl", high=limit)``).

    Attributes:
        metric: the plotted metric key.
        low, high: healthy range in the metric's unit; None: unbounded on that side.
        finite: NaN and infinities are outside.
        min_slope: lowest healthy least-squares slope over the last ``window`` steps (unit per step); None: none.
        window: steps of the slope fit (this one included); the check starts once ``window`` finite values exist.
    """

    metric: str
    low: float | None = None
    high: float | None = None
    finite: bool = True
    min_slope: float | None = None
    window: int = 20


def least_squares_slope(points: list[tuple[int, float]]) -> float:
    """Returns the least-squares slope of ``points`` [(step, value), ...] in value units per step.

    slope = sum((x - mean x)(y - mean y)) / sum((x - mean x)^2); e.g. [(1, 1.0), (2, 0.5), (3, 0.0)] gives -0.5.

    Raises:
        ValueError: fewer than 2 distinct steps.
    """
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0.0:
        raise ValueError(f"a slope needs 2 distinct steps; got {len(points)} point(s) at steps {sorted(set(xs))}")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def outside_band(band: Band, value: float, recent: list[tuple[int, float]]) -> str | None:
    """Returns why a step's ``value`` of ``band.metric`` is outside ``band`` (for the page's marker), None when inside.

    Args:
        band: the band.
        value: this step's value (any float, NaN included).
        recent: [(step, value)] of the metric's finite values up to and including this step, oldest first; the last
            ``band.window`` of them are fitted for ``min_slope``.
    """
    if not math.isfinite(value):
        return f"{band.metric} is {value}" if band.finite else None
    if band.low is not None and value < band.low:
        return f"{band.metric} {value:.4g} < {band.low:g}"
    if band.high is not None and value > band.high:
        return f"{band.metric} {value:.4g} > {band.high:g}"
    if band.min_slope is not None and len(recent) >= band.window:
        slope = least_squares_slope(recent[-band.window :])
        if slope < band.min_slope:
            return f"{band.metric} slope {slope:.3g}/step over {band.window} steps < {band.min_slope:g}"
    return None


class PageData:
    """The figures and samples behind the page, safe to update and read from several threads.

    Args:
        sample_steps: steps whose samples are kept (``monitor.page_sample_steps``); older ones are dropped.
        kl_limit: the KL guard's threshold drawn on the KL chart (``guard.kl_threshold``), None when off; it is
            also a band (``Band("algo/kl", high=kl_limit)``).
        bands: healthy bands (``monitor.bands``); each step's point names the bands it is outside (``outside``).
    """

    def __init__(self, sample_steps: int, kl_limit: float | None = None, bands: tuple[Band, ...] = ()) -> None:
        self.sample_steps = sample_steps
        self.kl_limit = kl_limit
        self.bands = tuple(bands) + ((Band("algo/kl", high=kl_limit),) if kl_limit is not None else ())
        self.history_id = 0  # changes when steps are recorded again (rollback, restart): the page reloads
        self._steps: list[int] = []
        self._points: list[dict[str, Any]] = []  # {"step": s, "values": {key: float | None}}, by step
        self._samples: OrderedDict[int, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def record_step(self, step: int, step_metrics: dict[str, float]) -> None:
        """Appends a step's plotted figures and the bands it is outside ({metric: reason}); a step at or before the
        last one (a rollback or a restart ran it again) first drops the steps from it on and changes ``history_id``.

        Costs O(window) per band, never the whole history."""
        values = {k: _json_number(v) for k, v in step_metrics.items() if metrics.is_charted(k)}
        point: dict[str, Any] = {"step": step, "values": values, "outside": {}}
        with self._lock:
            if self._steps and step <= self._steps[-1]:
                cut = bisect.bisect_left(self._steps, step)
                del self._steps[cut:], self._points[cut:]
                self.history_id += 1
            for band in self.bands:
                if band.metric in step_metrics and band.metric not in point["outside"]:
                    value = float(step_metrics[band.metric])
                    recent = [(p["step"], p["values"][band.metric]) for p in self._points[-band.window :]
                              if p["values"].get(band.metric) is not None]
                    reason = outside_band(band, value, recent + ([(step, value)] if math.isfinite(value) else []))
                    if reason:
                        point["outside"][band.metric] = reason
            self._steps.append(step)
            self._points.append(point)

    def record_samples(self, step: int, samples: list[StepSample]) -> None:
        """Keeps a step's samples (as JSON rows), dropping the oldest step beyond ``sample_steps``."""
        rows = [json_row(s) for s in samples]
        with self._lock:
            self._samples.pop(step, None)
            self._samples[step] = rows
            while len(self._samples) > self.sample_steps:
                self._samples.popitem(last=False)

    def metrics_since(self, since: int) -> dict[str, Any]:
        """Returns the /api/metrics document: {history_id, kl_limit, bands (each ``Band`` as a dict), points: the
        steps after ``since``, each {step, values, outside}}."""
        with self._lock:
            cut = bisect.bisect_right(self._steps, since)
            return {"history_id": self.history_id, "kl_limit": self.kl_limit, "bands": [asdict(b) for b in self.bands],
                    "points": self._points[cut:]}

    def samples_of(self, step: int | None) -> tuple[int, dict[str, Any]]:
        """Returns (HTTP status, /api/samples document) for ``step``, or for the newest kept step when None.

        The document is {step, steps (every kept step, oldest first), samples}; 404 with {error, steps} when
        ``step`` is not kept.
        """
        with self._lock:
            steps = list(self._samples)
            if step is None:
                step = steps[-1] if steps else None
                return 200, {"step": step, "steps": steps, "samples": list(self._samples.get(step, []))}
            if step not in self._samples:
                return 404, {"error": f"no samples kept for step {step}; the monitor keeps the last {self.sample_steps} "
                             f"steps with samples ({steps or 'none yet'}); every step's samples are in MLflow as "
                             f"samples/step_{step:06d}.json", "steps": steps}
            return 200, {"step": step, "steps": steps, "samples": list(self._samples[step])}


def json_bytes(doc: Any) -> bytes:
    """Returns ``doc`` as JSON with ``<``, ``>`` and ``&`` escaped (``\\u003c`` ...), so no markup in sample text
    survives even where JSON ends up inside HTML; ``JSON.parse`` gives the exact text back. NaN is refused."""
    text = json.dumps(doc, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


def static_file(path: str) -> tuple[bytes, str] | None:
    """Returns (content, content type) of the page's file served at URL ``path``, or None."""
    if path not in STATIC:
        return None
    name, ctype = STATIC[path]
    return (PAGE_DIR / name).read_bytes(), ctype


# (URL path, query) -> (HTTP status, body, content type): ``PageServer.respond``
Responder = Callable[[str, dict[str, list[str]]], tuple[int, bytes, str]]


def serve_http(respond: Responder, host: str, port: int) -> ThreadingHTTPServer:
    """Starts an HTTP server on ``host:port`` that answers GET with ``respond`` in a daemon thread; returns it
    (``server_address[1]`` is the bound port; stop it with ``shutdown()`` and ``server_close()``).

    Every answer carries the page's Content-Security-Policy, ``nosniff`` and ``no-store``; requests are not logged
    (scrapes stay out of the run's log).

    Raises:
        OSError: the address cannot be bound (the message names host and port and how to pick another port).
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            url = urllib.parse.urlsplit(self.path)
            code, body, ctype = respond(url.path, urllib.parse.parse_qs(url.query))
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as err:
        raise OSError(f"monitor: cannot bind {host}:{port} ({err}); set monitor.port (0 picks a free one)") from err
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="rlray-monitor-http", daemon=True).start()
    return server


def int_arg(query: dict[str, list[str]], name: str, default: int | None) -> int | None:
    """Returns query parameter ``name`` as an int, ``default`` when absent.

    Raises:
        ValueError: the value is not an integer (the message names the parameter and the value).
    """
    values = query.get(name)
    if not values:
        return default
    try:
        return int(values[-1])
    except ValueError:
        raise ValueError(f"{name}={values[-1]!r} is not a step number; use an integer, e.g. {name}=12") from None


class PageServer(abc.ABC):
    """The page's HTTP routing for one run, shared by the live monitor and a run read back from MLflow.

    Routes (``respond``): / and /static/monitor.js (the page), /api/charts (the chart definitions:
    ``metrics.charts_document``), /api/metrics?since=STEP (the plotted figures of the steps after STEP; 0 or absent:
    all), /api/samples?step=N (the kept samples of step N, absent: the newest; 404 when not kept), /health (JSON) and
    /metrics (Prometheus text, where ``prometheus`` has it; 404 otherwise). Errors are JSON {error}.

    A subclass gives ``health`` and may override ``samples_of`` and ``prometheus``; ``serve`` starts the server and
    ``close`` stops it (and sets ``_stop``, which a subclass's threads wait on).

    Args:
        run_id: the MLflow run id shown.
        data: the page's figures and samples.
        source: how the run is read, for error messages ("" for a live run).
    """

    def __init__(self, run_id: str, data: PageData, source: str = "") -> None:
        self.run_id = run_id
        self.page = data
        self.source = source
        self._server: ThreadingHTTPServer | None = None
        self._stop = threading.Event()

    @abc.abstractmethod
    def health(self) -> dict[str, Any]:
        """Returns the /health document (status, reason, step, alerts, ...); each subclass gives its own."""

    def samples_of(self, step: int | None) -> tuple[int, dict[str, Any]]:
        """Returns (HTTP status, /api/samples document) of ``step`` (None: the newest kept step)."""
        return self.page.samples_of(step)

    def prometheus(self) -> tuple[bytes, str] | None:
        """Returns (/metrics body, content type), or None when this run has no Prometheus figures (404)."""
        return None

    def respond(self, path: str, query: dict[str, list[str]]) -> tuple[int, bytes, str]:
        """Returns (HTTP status, body, content type) of GET ``path`` with ``query`` (the routes: the class docstring)."""
        if path in STATIC:
            return (200, *static_file(path))
        exposition = self.prometheus() if path == "/metrics" else None
        if exposition is not None:
            return (200, *exposition)
        try:
            if path == "/health":
                code, doc = 200, self.health()
            elif path == "/api/charts":
                code, doc = 200, metrics.charts_document()
            elif path == "/api/metrics":
                code, doc = 200, {"run_id": self.run_id, **self.page.metrics_since(int_arg(query, "since", 0))}
            elif path == "/api/samples":
                code, doc = self.samples_of(int_arg(query, "step", None))
            else:
                routes = "/, /api/charts, /api/metrics, /api/samples, /health"
                routes += (" or /metrics" if not self.source else " (/metrics is served by a live run's monitor only)")
                code, doc = 404, {"error": f"no page at {path}{self.source}; GET {routes}"}
        except ValueError as err:
            code, doc = 400, {"error": str(err)}
        return code, json_bytes(doc), "application/json"

    def serve(self, host: str, port: int) -> int:
        """Starts the HTTP server (``respond``) in a thread; returns the bound port.

        Raises:
            OSError: the address cannot be bound (the message names host and port).
        """
        self._server = serve_http(self.respond, host, port)
        return int(self._server.server_address[1])

    def close(self) -> None:
        """Stops the HTTP server and sets ``_stop`` (the subclass's threads end)."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
