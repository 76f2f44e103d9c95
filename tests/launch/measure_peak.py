"""Measures the peak resident memory of one learner rank's steady-state step on the CPU, for tests/launch/test_plan.py.

    python tests/launch/measure_peak.py [--world N --rank R --store FILE] KEY=VALUE ...

Builds ``PolicyLearner`` from the config overrides exactly as a run does (``rlray.run.build.learner_kwargs``; with
``--world`` > 1 wrapped in ``DistributedDataParallel`` over gloo, as ``ray.train.torch.prepare_model`` does on the
CPU, or sharded by FSDP2 with ``resources.learner.strategy=fsdp``, as a run does), runs one mini-batch of two
micro-batches (``learner.sequences_per_microbatch`` rows each, distinct prompts of ``data.max_prompt_tokens`` tokens
and responses of ``rollout.max_new_tokens``: the planner's padded worst case),
then resets the peak (``/proc/self/clear_refs`` 5) and runs it again: the optimizer state exists, as in every step
after the first. Prints one JSON line: the resident bytes after the imports (the baseline) and the peak of the
second step (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import re

import torch
import transformers  # noqa: F401  (part of the baseline: every learner process imports it)

from rlray.config import config_from_dict
from rlray.learner import PolicyLearner
from rlray.learner.objective import Normaliser
from rlray.learner.parallel import DDP
from rlray.models import resolve_model_path
from rlray.run import build
from rlray.schema import StepBatch, pack_sequences


def resident(field: str = "VmRSS") -> int:
    """Returns this process's resident bytes (VmRSS) or their peak since the last reset (VmHWM)."""
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--store", default="")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    # the learner group has --world ranks, as in a run (the plan decides the parallelism from it)
    cfg = config_from_dict({}, [*args.overrides, f"resources.learner.num_workers={args.world}"])
    model_dir = resolve_model_path(cfg.model.path)
    if args.world > 1:
        torch.distributed.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank,
                                             world_size=args.world)
    baseline = resident()
    fsdp = cfg.resources.learner.strategy == "fsdp"
    kwargs = build.learner_kwargs(cfg, args.world if fsdp else 1)  # FSDP2 needs only the process group opened above
    if args.world > 1 and not fsdp:
        kwargs["parallel"] = DDP(wrap_model=torch.nn.parallel.DistributedDataParallel)
    learner = PolicyLearner(model_dir, **kwargs)
    rows, prompt, response = 2 * cfg.learner.sequences_per_microbatch, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    vocab = learner.module.config.vocab_size  # fully_shard keeps the Hugging Face model's attributes
    g = torch.Generator().manual_seed(args.rank)
    inputs = pack_sequences(torch.randint(10, vocab - 1, (rows, prompt), generator=g).tolist(),
                            torch.randint(10, vocab - 1, (rows, response), generator=g).tolist(), 0)
    batch = StepBatch(inputs, response_mask=torch.ones(rows, response, dtype=torch.bool), reward=torch.zeros(rows),
                      group_id=torch.arange(rows), policy_version=torch.zeros(rows, dtype=torch.long),
                      rollout_logprobs=torch.zeros(rows, response), ref_logprobs=torch.zeros(rows, response),
                      advantages=torch.randn(rows, response, generator=g))
    spec = build.update_spec(cfg, args.world)
    norm = Normaliser(float(rows * response * args.world), float(rows * args.world), args.world)
    learner.train_minibatch(batch, spec.loss, norm, spec.batching)
    if args.world > 1:
        torch.distributed.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    learner.train_minibatch(batch, spec.loss, norm, spec.batching)
    print(json.dumps({"baseline": baseline, "peak": resident("VmHWM")}))
    if args.world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
