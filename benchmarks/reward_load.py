"""Load test of the reward server: a bounded concurrent client on loopback against POST /score.

    python benchmarks/reward_load.py [--config CONFIG] [dotted.key=value ...] [--requests 200]
                                     [--concurrency 8] [--url URL]

Without --url it starts Ray and the Serve application rlray-reward from CONFIG (default
configs/grpo_gsm8k_tiny.yaml, with reward.server.enabled) on 127.0.0.1, then sends, for each batch
size (completions per request: 1, 8, 32), ``--requests`` requests from ``--concurrency`` client
threads at most in flight. Completions are GSM8K-style texts (half end in the right '#### N').
Prints a markdown table: requests/s, completions/s, and p50/p99 latency per batch size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def make_body(batch: int, seed: int) -> bytes:
    """Returns the JSON body of one request with ``batch`` prompts, completions and references."""
    rng = np.random.default_rng(seed)
    answers = rng.integers(1, 1000, batch)
    completions = [
        f"First we add the numbers, then we subtract.\n#### {a if i % 2 == 0 else a + 1}" for i, a in enumerate(answers)
    ]
    body = {
        "prompts": [f"Problem {seed}-{i}: what is the answer?" for i in range(batch)],
        "completions": completions,
        "references": [f"The answer follows.\n#### {a}" for a in answers],
    }
    return json.dumps(body).encode()


def post(url: str, body: bytes) -> float:
    """Sends one request and returns its latency in seconds.

    Raises:
        urllib.error.URLError: the request failed (a failed request fails the benchmark).
    """
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()
    return time.perf_counter() - start


def run_load(url: str, batch: int, requests: int, concurrency: int) -> dict[str, float]:
    """Returns requests/s, completions/s and p50/p99 latency (ms) of ``requests`` requests, ``concurrency`` in flight."""
    bodies = [make_body(batch, i) for i in range(requests)]
    post(url, bodies[0])  # warm-up
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        latencies = np.asarray(list(pool.map(lambda b: post(url, b), bodies)))
    wall = time.perf_counter() - start
    return {
        "batch": batch,
        "requests_per_s": requests / wall,
        "completions_per_s": requests * batch / wall,
        "p50_ms": float(np.percentile(latencies, 50) * 1e3),
        "p99_ms": float(np.percentile(latencies, 99) * 1e3),
    }


def table(rows: list[dict[str, float]], concurrency: int) -> str:
    """Returns the results as a markdown table."""
    lines = [f"Reward server on loopback, {concurrency} requests in flight at most:", "",
             "| batch | requests/s | completions/s | p50 ms | p99 ms |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['requests_per_s']:.1f} | {r['completions_per_s']:.1f} | {r['p50_ms']:.1f} | "
              f"{r['p99_ms']:.1f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the load test and prints the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "grpo_gsm8k_tiny.yaml"))
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. reward.server.port=8123")
    p.add_argument("--url", help="an already running server's /score URL (skips starting one)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--batches", default="1,8,32")
    args = p.parse_args(argv)

    url = args.url
    if url is None:
        sys.path.insert(0, str(REPO))
        from rlray.config import load_config
        from rlray.launch.driver import init_ray, resolve_paths, start_reward_server
        from rlray.plan import resolve_plan

        cfg = resolve_paths(load_config(args.config, ["reward.server.enabled=true", *args.overrides]))
        init_ray(include_dashboard=False)
        start_reward_server(resolve_plan(cfg))
        url = f"http://127.0.0.1:{cfg.reward.server.port}/score"
    rows = [run_load(url, int(b), args.requests, args.concurrency) for b in args.batches.split(",")]
    print(table(rows, args.concurrency))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
