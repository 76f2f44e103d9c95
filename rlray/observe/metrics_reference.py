"""The metrics reference page (docs/reference/metrics.md), generated from the metric registry (``rlray.observe.metrics``).

``rlray config --metrics-reference`` prints it, ``make docs`` writes it, and tests/test_docs.py fails when the committed
page is not what the registry gives now, as for the config reference.
"""

from __future__ import annotations

import re

from rlray.observe import metrics as registry


def _cell(text: str) -> str:
    """Returns ``text`` safe in a Markdown table cell: outside code spans, pipes, angle brackets and asterisks escaped
    (``|advantage|`` is no column, ``<= 0`` no tag, ``lr*=0.5`` no emphasis)."""
    parts = re.split(r"(`[^`]+`)", text)
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    return "".join(parts)


def _shown() -> dict[str, list[str]]:
    """Returns {metric key: where a user sees it besides MLflow}: the live page's charts, the monitor's Prometheus
    gauges and the driver's progress line."""
    out: dict[str, list[str]] = {}
    for chart in registry.CHARTS:
        for key in chart.keys:
            out.setdefault(key, []).append(f"chart '{chart.title}'")
    for gauge in registry.STEP_GAUGES:
        out.setdefault(gauge.key, []).append(f"gauge `{gauge.name}`")
    for field in registry.PROGRESS_FIELDS:
        out.setdefault(field.key, []).append("progress line")
    return out


def metrics_markdown() -> str:
    """Returns the metrics reference as one Markdown page: every registered key (``METRICS``) by section with its unit,
    meaning and where it is shown (live-page chart, Prometheus gauge, progress line), then the keys named at run time
    (``FAMILIES``, ``TERM_FAMILIES``), the reward terms rlray adds (``TERMS``) and the renamed keys (``RENAMED_KEYS``).
    """
    shown = _shown()
    out = ["# Metrics reference", "",
           "Every metric key an rlray run logs to MLflow, section by section: its unit, what it measures and where the "
           "live page (`rlray monitor`, [Watching a run](../watching.md)) shows it. A key is logged at the steps where it applies (an "
           "algorithm option's keys only when the option is on). This page is generated from the metric registry "
           "(`rlray/observe/metrics.py`) by `rlray config --metrics-reference`; `make docs` writes it and a test fails "
           "when it is out of date.", "",
           "Step metrics are logged at every RL step (MLflow's step is the RL step); `eval/` keys when the run "
           "evaluates: before training, every `eval.every_steps` steps and at the end.", ""]
    sections: dict[str, list[registry.Metric]] = {}
    for metric in registry.METRICS:
        sections.setdefault(metric.section, []).append(metric)
    for section, found in sections.items():
        out += [f"## `{section}/`", "", "| key | unit | meaning | shown |", "|---|---|---|---|"]
        for m in found:
            out.append(f"| `{m.key}` | {_cell(m.unit)} | {_cell(m.meaning)} | {_cell(', '.join(shown.get(m.key, [])))} |")
        out.append("")
    out += ["## Keys named at run time", "",
            "The part in braces is a name known when the run starts: an episode stop reason, a number an environment "
            "reports, a k of `eval.pass_k`, or a reward term (each `reward.functions[].name` and "
            "`reward.judges[].name`).", "", "| key | unit | meaning |", "|---|---|---|"]
    for family in (*registry.FAMILIES, *registry.TERM_FAMILIES):
        out.append(f"| `{family.pattern}` | {_cell(family.unit)} | {_cell(family.meaning)} |")
    out += ["", "Reward terms rlray adds itself, besides `reward.functions`:", "", "| term | meaning |", "|---|---|"]
    out += [f"| `{term}` | {_cell(meaning)} |" for term, meaning in registry.TERMS.items()]
    out += ["", "## Renamed keys", "", "Keys of earlier releases and the keys that replaced them:", "",
            "| earlier key | now |", "|---|---|"]
    out += [f"| `{old}` | `{new}` |" for old, new in registry.RENAMED_KEYS.items()]
    out.append("")
    return "\n".join(out)
