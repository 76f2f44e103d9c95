"""Weight sync into N rollout actors (N = 1, 2) as bytes/s, beside a plain memory copy of the same bytes.

    python benchmarks/weight_sync.py                 # SmolLM2-135M-Instruct, default sizes
    python benchmarks/weight_sync.py --quick         # tiny-random, seconds-scale sizes
    python benchmarks/weight_sync.py --model tiny-random --actors 1 2 --repeats 5
    python benchmarks/weight_sync.py --part lora     # only the LoRA adapter-vs-merged comparison
    python benchmarks/weight_sync.py --part delta --steps 10  # full against delta syncs over 10 training steps

One child process per N (a fresh local Ray cluster each). The child loads the policy as the learner
does (float32 master weights) and exports it as rlray's learner does for every sync: its Hugging Face
state dict cast to the engine dtype (bf16), contiguous (``PolicyLearner.export_weights``). Then, in
the same process and run:

- ``memcpy``: copying those exact tensors into preallocated tensors of the same device (``copy_``),
  the bandwidth the machine gives a plain copy of these bytes;
- ``sync``: what stage 7 of the online step does after every update with the object-store backend
  (``rlray.rollout.weight_sync.ObjectStoreSync``): ``ray.put`` of the exported dict once (as raw bytes,
  ``rlray.rollout.wire``), then
  ``RolloutFleet.push_weights(..., wait=True)``: every actor fetches the dict and loads it in place
  (vLLM's layerwise reload, which on CPU also repacks the GEMM weights), tagged with a new version.
  ``put`` and ``load`` are reported separately.
- ``ipc`` on a CUDA machine: the same push through ``VllmTransferSync`` with CUDA IPC (one actor
  on GPU 0 beside this process, the colocated default), exported on the GPU. (The NCCL backend needs
  the actors on GPUs of their own, apart from the sender's; it is not measured here.)

bytes/s = bytes of the exported weights / seconds of a sync (median over ``--repeats`` after one
warm-up sync); the ratio is sync bytes/s / memcpy bytes/s (target >= 0.5). With N actors the same
bytes reach N engines, so the table also shows bytes delivered per second (N x bytes / seconds).
On CPU the actors split the cores (``resources.rollout.cpu_threads``).

LoRA (``--part lora``): a ``PolicyLearner`` with LoRA (rank 16 on every linear layer, tiny-random: 8;
seeded non-zero adapters) pushes to one rollout actor through ``ObjectStoreSync`` exactly as stage 7 does, once
per run with each ``rollout.lora_sync``: ``merged`` (the whole bf16 model, adapter merged in, into an engine
without LoRA) and ``adapter`` (the bf16 adapter alone, into an engine with vLLM's runtime LoRA). Per sync: the
bytes put in the object store, the export seconds (learner side, timed alone) and the whole push (export, put,
load on the actor; medians over ``--repeats`` after one warm-up), and the generation speed of each engine (8 GSM8K prompts x
64 sampled tokens, after one warm-up call). A third run, in float32, samples the same prompts with the adapter
and then with the merged weights pushed to the same engine (same seed): whether the tokens agree, and the max
|logprob difference| between the two, and against the learner's own forward of the adapted policy.

Delta (``--part delta``, ``rollout.weight_payload``): a float32 ``PolicyLearner`` takes ``--steps`` real AdamW
steps (learner.lr's default 1e-6, the next-token loss of 4 GSM8K prompts per step) and after each one pushes to two
rollout actors through ``ObjectStoreSync`` exactly as stage 7 does: one with ``full`` syncs, one with ``delta``
(the first push of each is full), once per engine dtype (bf16, float32). Per step and mode: bytes put in the object
store, the whole push (export, encode, put, load) and the engine's pause (the fleet's ``push_weights``: fetch,
apply and check the delta, load), and the fraction of values whose engine-dtype bits changed.

Prints markdown tables and writes bench_results/weight_sync.json ("runs"; "lora"; "delta").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib

SIZES = {
    "quick": dict(model="tiny-random", actors=[1, 2], repeats=2, lora_rank=8, steps=3),
    "default": dict(model="smollm2-135m-instruct", actors=[1, 2], repeats=4, lora_rank=16, steps=10),
}
LORA_RUNS = ("merged", "adapter", "exact")  # rollout.lora_sync=merged, =adapter (bf16); both in float32 (exactness)
LORA_PROMPTS, LORA_NEW_TOKENS = 8, 64
MAX_MODEL_LEN = 512
KV_CACHE_GIB = 0.5


class ExportedPolicy:
    """The learner side of a sync: holds the float32 policy and exports it like ``PolicyLearner.export_weights``."""

    sharded = False

    def __init__(self, model_dir: str, device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)

    def export_weights(self, dtype: Any, device: Any = "cpu") -> dict[str, Any]:
        """Returns the HF state dict cast to ``dtype`` on ``device``, contiguous (what every sync ships)."""
        return {k: v.detach().to(device, dtype).contiguous() for k, v in self.module.state_dict().items()}


def memcpy_seconds(tensors: dict[str, Any], repeats: int) -> list[float]:
    """Returns the seconds of ``repeats`` copies of every tensor into preallocated tensors on the same device."""
    import torch

    dst = {k: torch.empty_like(v) for k, v in tensors.items()}
    cuda = any(v.is_cuda for v in tensors.values())
    out = []
    for _ in range(repeats + 1):  # the first copy touches the destination pages; not counted
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for k, v in tensors.items():
            dst[k].copy_(v)
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out[1:]


def actors_config(actors: int, backend: str, overrides: tuple[str, ...] = ("model.dtype=bfloat16",)) -> Any:
    """Returns the rlray config of ``actors`` rollout actors (CPU: split cores; CUDA: shares of GPU 0), with
    ``overrides`` (dotted keys) applied."""
    import torch

    from rlray.config import config_from_dict
    from rlray.cores import split_cores

    tree: dict[str, Any] = {"resources": {"rollout": {"num_workers": actors}},
                            "rollout": {"kv_cache_gib": KV_CACHE_GIB, "weight_sync": backend}}
    if backend == "ipc":  # CUDA IPC: the actors share GPU 0 with this process (the learner's place)
        tree["resources"].update(colocate=True, learner={"gpus": 0.5})
        tree["resources"]["rollout"]["gpus"] = round(0.4 / actors, 2)
        tree["rollout"]["gpu_memory_utilization"] = round(0.3 / actors, 2)
    elif torch.cuda.is_available():
        tree["resources"]["rollout"]["gpus"] = round(0.4 / actors, 2)
        tree["rollout"]["gpu_memory_utilization"] = round(0.3 / actors, 2)
    else:
        tree["resources"]["rollout"]["cpu_threads"] = split_cores(actors, sorted(os.sched_getaffinity(0)))
    return config_from_dict(tree, list(overrides))


def time_object_store(fleet: Any, weights: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """Returns put / load / total seconds of 1 + ``repeats`` object-store syncs (the first is the warm-up, dropped)."""
    import ray

    from rlray.rollout.wire import pack_weights

    put, load, total = [], [], []
    for version in range(1, repeats + 2):
        start = time.perf_counter()
        ref = ray.put(pack_weights(weights))
        mid = time.perf_counter()
        fleet.push_weights(ref, version, wait=True)
        end = time.perf_counter()
        put.append(mid - start)
        load.append(end - mid)
        total.append(end - start)
        del ref
    return {"put_s": put[1:], "load_s": load[1:], "seconds": total[1:]}


def time_transfer(fleet: Any, policy: ExportedPolicy, backend: str, repeats: int) -> dict[str, list[float]]:
    """Returns the seconds of 1 + ``repeats`` pushes through vLLM's weight-transfer engines (CUDA only; warm-up dropped)."""
    import torch

    from rlray.rollout.weight_sync import VllmTransferSync

    sync = VllmTransferSync(fleet, backend, torch.bfloat16, tensor_parallel_size=1)
    total = []
    for version in range(1, repeats + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        sync.push(policy, 0, version)
        torch.cuda.synchronize()
        total.append(time.perf_counter() - start)
    return {"seconds": total[1:]}


def child(args: dict, actors: int, backend: str) -> dict[str, Any]:
    """Measures memcpy and one backend's sync into ``actors`` rollout actors, in this process."""
    import ray
    import torch

    from rlray.launch.actors import kill_actors, start_rollout_actors
    from rlray.models import resolve_model_path
    from rlray.plan import resolve_plan
    from rlray.rollout.fleet import RolloutFleet

    model_dir = resolve_model_path(args["model"])
    on_gpu = backend != "object_store"
    policy = ExportedPolicy(model_dir, "cuda" if torch.cuda.is_available() else "cpu")
    weights = policy.export_weights(torch.bfloat16, "cuda" if on_gpu else "cpu")
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    copy_s = memcpy_seconds(weights, max(args["repeats"], 9))  # cheap; more samples steady the median
    cfg = actors_config(actors, backend)
    benchlib.init_local_ray()
    handles = start_rollout_actors(resolve_plan(cfg), model_dir, MAX_MODEL_LEN)
    try:
        fleet = RolloutFleet(handles)
        timed = time_object_store(fleet, weights, args["repeats"]) if not on_gpu else time_transfer(
            fleet, policy, backend, args["repeats"])
        versions = ray.get([h.policy_version.remote() for h in handles])
    finally:
        kill_actors(handles)
        ray.shutdown()
    return {"bytes": nbytes, "tensors": len(weights), "memcpy_s": copy_s, "actors": actors, "backend": backend,
            "versions": versions, "cpu_threads": cfg.resources.rollout.cpu_threads, **timed}


def lora_learner(model_dir: str, rank: int) -> Any:
    """Returns a float32 ``PolicyLearner`` with LoRA of ``rank`` on every linear layer (alpha = 2 x rank), its
    adapters set to seeded noise (peft starts lora_B at 0: an adapter that would change nothing)."""
    import torch

    from rlray.learner import OptimizerSpec, PolicyLearner

    learner = PolicyLearner(model_dir, dtype="float32", optim=OptimizerSpec(lr=1e-5, max_grad_norm=1.0),
                            temperature=1.0, use_reference=False,
                            lora={"rank": rank, "alpha": 2.0 * rank, "dropout": 0.0, "target_modules": "all-linear"})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in learner.module.named_parameters():
            if "lora_B" in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=g))
    return learner


def time_lora_syncs(sync: Any, learner: Any, repeats: int) -> dict[str, Any]:
    """Returns the payload bytes, and the export seconds (an export alone) and whole-push seconds of 1 + ``repeats``
    pushes (warm-up dropped)."""
    from rlray.models.adapters import AdapterWeights

    export, total = [], []
    for version in range(1, repeats + 2):
        start = time.perf_counter()
        payload = sync.export(learner)
        export.append(time.perf_counter() - start)
        packed = payload.tensors if isinstance(payload, AdapterWeights) else payload
        nbytes = sum(int(raw.nbytes) for raw, _, _ in packed.values())
        del payload, packed
        start = time.perf_counter()
        sync.push(learner, 0, version)
        total.append(time.perf_counter() - start)
    return {"bytes": nbytes, "export_s": export[1:], "seconds": total[1:]}


def lora_child(args: dict, kind: str) -> dict[str, Any]:
    """Measures one LoRA run (``LORA_RUNS``) with one rollout actor, in this process."""
    import ray
    import torch

    from rlray.launch.actors import kill_actors, start_rollout_actors
    from rlray.models import resolve_model_path
    from rlray.plan import resolve_plan
    from rlray.rollout import SamplingSpec
    from rlray.rollout.fleet import RolloutFleet
    from rlray.rollout.weight_sync import ObjectStoreSync

    model_dir = resolve_model_path(args["model"])
    learner = lora_learner(model_dir, args["lora_rank"])
    dtype = "float32" if kind == "exact" else "bfloat16"
    sync_mode = "merged" if kind == "merged" else "adapter"
    cfg = actors_config(1, "object_store", (f"model.dtype={dtype}", f"model.lora.rank={args['lora_rank']}",
                                            f"rollout.lora_sync={sync_mode}"))
    _, prompts = benchlib.gsm8k_prompts(args["model"], LORA_PROMPTS, 256)
    spec = SamplingSpec(n=1, max_new_tokens=LORA_NEW_TOKENS, temperature=1.0, seed=0)
    benchlib.init_local_ray()
    handles = start_rollout_actors(resolve_plan(cfg), model_dir, MAX_MODEL_LEN)
    try:
        fleet = RolloutFleet(handles)
        sync = ObjectStoreSync(fleet, getattr(torch, dtype), wait=True, adapter=sync_mode == "adapter")
        if kind == "exact":
            return exactness(fleet, sync, learner, prompts, spec)
        out = time_lora_syncs(sync, learner, args["repeats"])
        fleet.generate(prompts[:2], dataclasses.replace(spec, max_new_tokens=8))  # warm-up
        start = time.perf_counter()
        tokens = sum(len(c.response_token_ids) for c in fleet.generate(prompts, spec))
        out["generate_tokens_per_s"] = tokens / (time.perf_counter() - start)
        out["engine_version"] = ray.get(handles[0].policy_version.remote())
        return {"kind": kind, **out}
    finally:
        kill_actors(handles)
        ray.shutdown()


def exactness(fleet: Any, sync: Any, learner: Any, prompts: list[list[int]], spec: Any) -> dict[str, Any]:
    """Returns how the adapter path's samples compare with the merged path's on the same engine (float32, same seed)
    and with the learner's own forward: tokens equal, max |logprob difference| (nats), tokens compared."""
    import ray
    import torch

    from rlray.rollout.wire import pack_weights

    sync.push(learner, 0, 1)  # the adapter (ObjectStoreSync with adapter=True)
    via_adapter = fleet.generate(prompts, spec)
    fleet.push_weights(ray.put(pack_weights(learner.export_weights(torch.float32))), 2, wait=True)
    via_merged = fleet.generate(prompts, spec)
    same = [a.response_token_ids == m.response_token_ids for a, m in zip(via_adapter, via_merged, strict=True)]
    vs_merged = max(max(abs(x - y) for x, y in zip(a.rollout_logprobs, m.rollout_logprobs, strict=False))
                    for a, m in zip(via_adapter, via_merged, strict=True))
    vs_learner, vs_base = 0.0, 0.0
    with torch.no_grad():
        for c in via_adapter:
            ids = torch.tensor([prompts[c.prompt_index] + c.response_token_ids])
            at = torch.arange(len(prompts[c.prompt_index]) - 1, ids.shape[1] - 1)
            got = torch.tensor(c.rollout_logprobs)
            own = learner.module(input_ids=ids).logits[0].log_softmax(-1)[at, ids[0, at + 1]]
            with learner.module.disable_adapter():
                base = learner.module(input_ids=ids).logits[0].log_softmax(-1)[at, ids[0, at + 1]]
            vs_learner = max(vs_learner, float((got - own).abs().max()))
            vs_base = max(vs_base, float((got - base).abs().max()))
    return {"kind": "exact", "same_tokens": all(same), "tokens": sum(len(c.response_token_ids) for c in via_adapter),
            "max_diff_vs_merged": vs_merged, "max_diff_vs_learner": vs_learner, "max_diff_vs_base": vs_base}


def delta_child(args: dict, dtype: str) -> dict[str, Any]:
    """Measures full against delta syncs over ``args["steps"]`` real learner steps, engines in ``dtype``, here."""
    import ray
    import torch

    from rlray.launch.actors import kill_actors, start_rollout_actors
    from rlray.learner import OptimizerSpec, PolicyLearner
    from rlray.models import resolve_model_path
    from rlray.plan import resolve_plan
    from rlray.rollout.fleet import RolloutFleet
    from rlray.rollout.weight_sync import ObjectStoreSync

    model_dir = resolve_model_path(args["model"])
    learner = PolicyLearner(model_dir, dtype="float32", optim=OptimizerSpec(lr=1e-6, max_grad_norm=1.0),
                            temperature=1.0, use_reference=False)
    _, prompts = benchlib.gsm8k_prompts(args["model"], 4 * args["steps"], 256)
    cfg = actors_config(2, "object_store", (f"model.dtype={dtype}",))
    benchlib.init_local_ray()
    handles = start_rollout_actors(resolve_plan(cfg), model_dir, MAX_MODEL_LEN)
    try:
        syncs, pauses = {}, {}
        for mode, handle in zip(("full", "delta"), handles, strict=True):
            fleet = RolloutFleet([handle])
            syncs[mode] = ObjectStoreSync(fleet, getattr(torch, dtype), wait=True, delta=mode == "delta")
            pauses[mode] = []
            fleet.push_weights = _timed(fleet.push_weights, pauses[mode])
        steps = []
        for step in range(args["steps"] + 1):  # step 0: the first push (whole in both modes)
            if step:
                batch = [torch.tensor([ids]) for ids in prompts[4 * (step - 1): 4 * step]]
                learner.optimizer_step(batch, lambda model, ids: (model(input_ids=ids, labels=ids).loss / 4, {}))
            row = {"step": step}
            for mode, sync in syncs.items():
                start = time.perf_counter()
                sync.push(learner, 0, step + 1)
                m = sync.last_metrics
                row[mode] = {"seconds": time.perf_counter() - start, "pause_s": pauses[mode][-1],
                             "bytes": m["rollout/weight_sync_bytes"],
                             "changed": m.get("rollout/weight_sync_changed_fraction"),
                             "resyncs": m.get("rollout/weight_sync_full_resyncs", 0.0)}
            steps.append(row)
        versions = ray.get([h.policy_version.remote() for h in handles])
    finally:
        kill_actors(handles)
        ray.shutdown()
    return {"dtype": dtype, "steps": steps, "versions": versions}


def _timed(fn: Any, into: list[float]) -> Any:
    """Returns ``fn`` that appends the seconds of each call to ``into``."""
    def call(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            into.append(time.perf_counter() - start)
    return call


DELTA_HEADERS = ["engine dtype", "mode", "MiB per sync", "sync (s)", "engine pause (s)", "changed fraction",
                 "full resyncs"]


def delta_table(runs: dict[str, Any]) -> str:
    """Returns the markdown table of full against delta syncs (medians over the training steps; step 0 apart)."""
    rows = []
    for dtype, r in runs.items():
        if "error" in r:
            rows.append([dtype, f"FAILED: {r['error']}", *["n/a"] * (len(DELTA_HEADERS) - 2)])
            continue
        trained = r["steps"][1:]
        for mode in ("full", "delta"):
            got = [s[mode] for s in trained]
            changed = [g["changed"] for g in got if g["changed"] is not None]
            rows.append([dtype, mode, benchlib.fmt(statistics.median(g["bytes"] for g in got) / 2**20, 2),
                         benchlib.fmt(statistics.median(g["seconds"] for g in got), 3),
                         benchlib.fmt(statistics.median(g["pause_s"] for g in got), 3),
                         " ".join(f"{c:.4f}" for c in changed) or "n/a", str(int(sum(g["resyncs"] for g in got)))])
    return benchlib.markdown_table(DELTA_HEADERS, rows)


LORA_HEADERS = ["lora_sync", "MiB per sync", "export (s)", "push (s)", "generate tokens/s", "engine version"]


def lora_tables(runs: dict[str, Any]) -> str:
    """Returns the markdown table of the merged and adapter syncs and the exactness line (failed runs show why)."""
    mib, rows, lines = 2**20, [], []
    for kind in ("merged", "adapter"):
        r = runs.get(kind, {"error": "not run"})
        if "error" in r:
            rows.append([kind, f"FAILED: {r['error']}", *["n/a"] * (len(LORA_HEADERS) - 2)])
            continue
        rows.append([kind, benchlib.fmt(r["bytes"] / mib, 2), benchlib.fmt(statistics.median(r["export_s"]), 3),
                     benchlib.fmt(statistics.median(r["seconds"]), 3), benchlib.fmt(r["generate_tokens_per_s"], 0),
                     str(r["engine_version"])])
    lines.append(benchlib.markdown_table(LORA_HEADERS, rows))
    e = runs.get("exact", {"error": "not run"})
    if "error" in e:
        lines.append(f"\nexactness (float32): FAILED: {e['error']}")
    else:
        lines.append(f"\nexactness (float32, {e['tokens']} sampled tokens): same tokens {'yes' if e['same_tokens'] else 'NO'}; "
                     f"max |adapter - merged| {e['max_diff_vs_merged']:.2e} nats, max |adapter - learner| "
                     f"{e['max_diff_vs_learner']:.2e} nats (the adapter's own effect: max |adapter - base| "
                     f"{e['max_diff_vs_base']:.2e} nats)")
    return "\n".join(lines)


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """Returns the figures of one run: median seconds, bytes/s of sync and memcpy, their ratio."""
    sync_s = statistics.median(raw["seconds"])
    copy_s = statistics.median(raw["memcpy_s"])
    out = {
        "sync_s": sync_s,
        "memcpy_s": copy_s,
        "sync_bytes_per_s": benchlib.ratio(raw["bytes"], sync_s),
        "memcpy_bytes_per_s": benchlib.ratio(raw["bytes"], copy_s),
        "delivered_bytes_per_s": benchlib.ratio(raw["bytes"] * raw["actors"], sync_s),
    }
    out["sync_vs_memcpy"] = benchlib.ratio(out["sync_bytes_per_s"], out["memcpy_bytes_per_s"])
    for key in ("put_s", "load_s"):
        if key in raw:
            out[key.replace("_s", "_median_s")] = statistics.median(raw[key])
    return out


def runs_here(actors: list[int]) -> list[tuple[int, str]]:
    """Returns the (N actors, backend) runs of this machine: object_store for every N, plus CUDA IPC x1 on CUDA."""
    import torch

    runs = [(n, "object_store") for n in actors]
    if torch.cuda.is_available():
        runs.append((1, "ipc"))  # the default backend of a colocated GPU run (one actor beside the learner)
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs every (N, backend); prints the table and writes bench_results/weight_sync.json; returns the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-random, seconds-scale sizes")
    parser.add_argument("--model", help="model alias or folder")
    parser.add_argument("--actors", type=int, nargs="+", help="rollout actor counts (default: 1 2)")
    parser.add_argument("--repeats", type=int, help="timed syncs after one warm-up")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit per run")
    parser.add_argument("--steps", type=int, help="training steps of the delta part")
    parser.add_argument("--part", choices=("all", "throughput", "lora", "delta"), default="all",
                        help="throughput: N actors x backend; lora: adapter against merged syncs; delta: full against "
                             "delta syncs over training steps; all: every part")
    args = parser.parse_args(argv)
    size = dict(SIZES["quick" if args.quick else "default"])
    size.update({k: v for k, v in vars(args).items() if k in size and v is not None})
    work = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    (work / "args.json").write_text(json.dumps(size))
    runs: dict[str, Any] = {}
    for actors, backend in runs_here(size["actors"]) if args.part in ("all", "throughput") else []:
        name = f"{backend} x{actors}"
        result = work / f"{backend}-{actors}.json"
        raw = benchlib.run_script_child(__file__, [actors, backend, work / "args.json", result], result_path=result,
                                        log_path=result.with_suffix(".log"), timeout_s=args.timeout_s, label=name)
        if "error" in raw:
            runs[name] = {"actors": actors, "backend": backend, "error": raw["error"], "log_tail": raw["log_tail"]}
            continue
        runs[name] = {**raw, **summarise(raw)}
    lora = {kind: lora_run(work, kind, args.timeout_s) for kind in LORA_RUNS} if args.part in ("all", "lora") else {}
    delta = {d: lora_run(work, d, args.timeout_s, "delta") for d in ("bfloat16", "float32")} if args.part in (
        "all", "delta") else {}
    if runs:
        print(f"\n**weight sync** ({size['model']}): {size['repeats']} timed syncs after 1 warm-up, bf16 weights\n")
        print(table(runs) + "\n")
    if lora:
        print(f"\n**LoRA weight sync** ({size['model']}, rank {size['lora_rank']} all-linear, 1 rollout actor): "
              f"{size['repeats']} timed pushes after 1 warm-up, bf16\n")
        print(lora_tables(lora) + "\n")
    if delta:
        print(f"\n**Delta weight sync** ({size['model']}, full fine-tuning, lr 1e-6, {size['steps']} training steps, "
              "1 rollout actor per mode): medians over the steps; changed fraction per step\n")
        print(delta_table(delta) + "\n")
    results = {"size": size, "runs": runs, "lora": lora, "delta": delta}
    print(f"wrote {benchlib.write_results('weight_sync', results)}")
    return results


def lora_run(work: Path, kind: str, timeout_s: float, part: str = "lora") -> dict[str, Any]:
    """Returns one LoRA (or ``part`` delta) run's figures from a child process (``lora_child``, ``delta_child``),
    or its error."""
    result = work / f"{part}-{kind}.json"
    raw = benchlib.run_script_child(__file__, [1, f"{part}-{kind}", work / "args.json", result], result_path=result,
                                    log_path=result.with_suffix(".log"), timeout_s=timeout_s, label=f"{part} {kind}")
    return {"error": raw["error"], "log_tail": raw["log_tail"]} if "error" in raw else raw


HEADERS = ["backend", "actors", "MiB", "sync (s)", "put (s)", "load (s)", "sync MiB/s", "memcpy MiB/s",
           "sync / memcpy", "delivered MiB/s (N x)"]


def table(runs: dict[str, Any]) -> str:
    """Returns the markdown table of the weight-sync runs (a failed run shows its error)."""
    mib = 2**20
    rows = []
    for r in runs.values():
        if "error" in r:
            rows.append([r["backend"], str(r["actors"]), f"FAILED: {r['error']}", *["n/a"] * (len(HEADERS) - 3)])
            continue
        rows.append([r["backend"], str(r["actors"]), benchlib.fmt(r["bytes"] / mib, 1), benchlib.fmt(r["sync_s"], 3),
                     benchlib.fmt(r.get("put_median_s"), 3), benchlib.fmt(r.get("load_median_s"), 3),
                     benchlib.fmt(r["sync_bytes_per_s"] / mib, 0), benchlib.fmt(r["memcpy_bytes_per_s"] / mib, 0),
                     r["sync_vs_memcpy"], benchlib.fmt(r["delivered_bytes_per_s"] / mib, 0)])
    return benchlib.markdown_table(HEADERS, rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        n, backend, args_json, result_json = sys.argv[2:]
        given = json.loads(Path(args_json).read_text())
        if backend.startswith("delta-"):
            out = delta_child(given, backend.removeprefix("delta-"))
        elif backend.startswith("lora-"):
            out = lora_child(given, backend.removeprefix("lora-"))
        else:
            out = child(given, int(n), backend)
        Path(result_json).write_text(json.dumps(out))
    else:
        main()
