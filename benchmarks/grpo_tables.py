"""The markdown tables of benchmarks/grpo_vs_trl.py's results: one model's runs (``table``, with ``learner_lines`` and
``memory_table``, which benchmarks/env_vs_trl.py reuses) and the ``--scaling`` sweep (``scaling_table``, ``slope``).
grpo_vs_trl.py re-exports each name, so ``grpo_vs_trl.table`` and the others still work.
"""

from __future__ import annotations

from typing import Any

import benchlib

HEADERS = ["run", "placement", "median step (s)", "generated tok/s", "trained tok/s", "peak RSS (GiB)",
           "peak PSS (GiB)", "step 1 done at (s)", "step time / TRL", "gen tok/s / TRL", "trained tok/s / TRL",
           "PSS / TRL"]
MEMORY_HEADERS = ["run", "process", "processes", "PSS (GiB)", "RSS (GiB)", "share of the run's PSS"]


def table(model: str, result: dict[str, Any]) -> str:
    """Returns the markdown table of one model's runs (a failed run shows its error)."""
    rows = []
    for name, r in result["runs"].items():
        if "error" in r:
            rows.append([name, r["placement"], f"FAILED: {r['error']}", *["n/a"] * (len(HEADERS) - 3)])
            continue
        rows.append([name, r["placement"], r["median_step_s"], benchlib.fmt(r["generated_tokens_per_s"], 1),
                     benchlib.fmt(r["trained_tokens_per_s"], 1), r["peak_rss_gib"], r["peak_pss_gib"],
                     benchlib.fmt(r["first_step_end_s"], 1), r["step_time_vs_trl"], r["generated_tokens_per_s_vs_trl"],
                     r["trained_tokens_per_s_vs_trl"], r["peak_pss_vs_trl"]])
    s = result["spec"]
    head = (f"**{model}**: {s['prompts_per_step']} prompts x {s['samples_per_prompt']} samples, "
            f"{s['max_new_tokens']} new tokens, {s['steps']} steps (first {s['warmup']} not counted), "
            f"{'bf16 autocast' if s.get('dtype') == 'bfloat16' else 'float32'}")
    lines = [head, "", benchlib.markdown_table(HEADERS, rows)]
    async_vs_sync = result["runs"].get("rlray-async", {}).get("step_time_vs_sync")
    if async_vs_sync is not None:
        lines += ["", f"rlray async / sync step time: {async_vs_sync:.2f}"]
    lines += learner_lines(result)
    lines += ["", "Memory per process at each run's peak (PSS: shared pages split among their sharers):", "",
              memory_table(result)]
    return "\n".join(lines)


def learner_lines(result: dict[str, Any]) -> list[str]:
    """Returns a line per rlray run: its median logprobs and update stage times and the tokens its learner computed
    per step (real, padding, shared: ``perf/learner_tokens_*``), so a faster update is explained, not only timed."""
    lines = []
    for name, r in result["runs"].items():
        stages, tokens = r.get("stage_median_s", {}), r.get("learner_tokens_median", {})
        if not stages or "timing/update_s" not in stages:
            continue
        counts = ", ".join(f"{benchlib.fmt(tokens.get(f'perf/learner_tokens_{k}'), 0)} {k}"
                           for k in ("real", "padding", "shared"))
        lines.append(f"{name}: logprobs {benchlib.fmt(stages.get('timing/logprobs_s'), 1)} s, update "
                     f"{benchlib.fmt(stages['timing/update_s'], 1)} s per step (median); learner tokens per step: "
                     f"{counts}")
    return [""] + lines if lines else []


def memory_table(result: dict[str, Any]) -> str:
    """Returns the per-process memory table of one model's runs: every process label's PSS and RSS at the
    sample where the run's summed PSS peaked, largest first (``benchlib.TreeMemory.peak_by_process``)."""
    rows = []
    for name, r in result["runs"].items():
        total = r.get("peak_pss_gib") or 0.0
        for label, m in sorted(r.get("peak_by_process", {}).items(), key=lambda kv: -kv[1]["pss_gib"]):
            rows.append([name, label, int(m["processes"]), benchlib.fmt(m["pss_gib"], 2), benchlib.fmt(m["rss_gib"], 2),
                         benchlib.fmt_percent(m["pss_gib"] / total if total else None)])
    return benchlib.markdown_table(MEMORY_HEADERS, rows)


SCALING_HEADERS = ["grows", "value", "run", "median step (s)", "peak PSS (GiB)", "step time / TRL", "PSS / TRL"]


def slope(xs: list[float], ys: list[float | None]) -> float | None:
    """Returns the least-squares slope of ys over xs (None with fewer than two known points).

    Example: ``slope([4, 8, 16], [10.0, 18.0, 34.0])`` is 2.0 (seconds per prompt).
    """
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else None


def scaling_table(result: dict[str, Any]) -> str:
    """Returns the scaling table (one row per point and run) and the slope lines under it."""
    rows = [[p["grows"], p["value"], name, r.get("median_step_s", "FAILED"), r.get("peak_pss_gib"),
             r.get("step_time_vs_trl"), r.get("peak_pss_vs_trl")]
            for p in result["points"] for name, r in p["runs"].items()]
    lines = [benchlib.markdown_table(SCALING_HEADERS, rows), ""]
    for grows, per_run in result["slopes"].items():
        unit = "prompt" if grows == "prompts_per_step" else "new token"
        lines.append(f"- {grows}: " + "; ".join(
            f"{name} {benchlib.fmt(s['step_s_per_unit'], 3)} s and {benchlib.fmt(s['pss_gib_per_unit'], 4)} GiB per {unit}"
            for name, s in per_run.items()))
    return "\n".join(lines)
