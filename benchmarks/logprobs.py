"""Response logprobs from logits: autograd's logsumexp + gather against rlray's chunked ``token_logprobs``.

The learner's update computes ``logprobs [B, T]`` from ``logits [B, T, V]`` and backpropagates through them.
This script times forward + backward of that step alone at SmolLM2's vocabulary (49,152) and reports each way's
peak resident memory above the inputs, every variant in a fresh child process (``ru_maxrss``, so the figures
do not mix). Rows: ``autograd`` (the learner before round 2's change: ``logits / temperature``, logsumexp,
gather), ``chunked`` (``token_logprobs``, a new gradient buffer) and ``chunked-inplace`` (the gradient built
in the logits' storage, what the update uses when no other loss term reads the logits).

    .venv/bin/python benchmarks/logprobs.py [--rows 8] [--tokens 64] [--vocab 49152] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from benchlib import GIB, REPO, fmt, markdown_table, ratio, write_results

VARIANTS = ("autograd", "chunked", "chunked-inplace")


def _measure(variant: str, rows: int, tokens: int, vocab: int, repeats: int) -> dict[str, float]:
    """Runs in the child: returns the median seconds of forward + backward and the peak RSS growth (GiB)."""
    import torch

    sys.path.insert(0, str(REPO))
    from rlray.learner.logprobs import token_logprobs

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(rows, tokens, vocab, generator=gen)
    ids = torch.randint(0, vocab, (rows, tokens), generator=gen)
    weights = torch.randn(rows, tokens, generator=gen)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = []
    for _ in range(repeats):
        leaf = base.clone().requires_grad_()  # stands for the lm_head output
        start = time.perf_counter()
        logits = leaf * 1.0  # a non-leaf, as the model's output is
        if variant == "autograd":
            scaled = logits / 1.0
            lp = scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
        else:
            lp = token_logprobs(logits, ids, inplace_backward=variant == "chunked-inplace")
        (lp * weights).sum().backward()
        seconds.append(time.perf_counter() - start)
        del leaf, logits, lp
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": statistics.median(seconds), "peak_growth_gib": (peak - before) / GIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--tokens", type=int, default=64, help="response tokens per sequence")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child, args.rows, args.tokens, args.vocab, args.repeats)))
        return
    sizes = ["--rows", str(args.rows), "--tokens", str(args.tokens), "--vocab", str(args.vocab),
             "--repeats", str(args.repeats)]
    results = {}
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--child", variant, *sizes], check=True, capture_output=True,
                             text=True)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    one = args.rows * args.tokens * args.vocab * 4 / GIB
    base = results["autograd"]
    rows = [[v, fmt(r["seconds"], 3), fmt(ratio(r["seconds"], base["seconds"])), fmt(r["peak_growth_gib"], 3),
             fmt(r["peak_growth_gib"] / one, 1)] for v, r in results.items()]
    print(f"logits [{args.rows}, {args.tokens}, {args.vocab}] float32 = {one:.3f} GiB; median of {args.repeats}")
    print(markdown_table(["variant", "fwd+bwd (s)", "time / autograd", "peak RSS growth (GiB)",
                          "peak / one logits tensor"], rows))
    write_results("logprobs", {"sizes": vars(args), "results": results})


if __name__ == "__main__":
    main()
