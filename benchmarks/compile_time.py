"""Compile time of AutoSP against a plain ``torch.compile`` of the same model, by depth.

Two processes (CPU/gloo) compile and run the first training step (forward and backward) of a
small Llama at each depth (``--layers``), with each backend (``--backends``; every backend in
processes of its own, so that one backend's compiles do not slow the next one's), in two variants
measured one after the other in the same processes, ``--reps`` times (default 2), the variant
compiled first alternating, and the mean is kept - in this script's runs the second of two
compiles of a model at one depth was often the faster one by 10-40% (whatever the process keeps
past ``torch._dynamo.reset()``), so with an even number of repetitions each variant is first as
often as the other:

* ``plain``: ``torch.compile(step, backend=...)`` of the model without SP; each process runs the
  whole sequence;
* ``autosp``: the AutoSP backend as ``AutoSPStrategy`` builds it by default (sp=2, SAC on, the
  fused vocabulary loss), rank 0 of the SP group.

Both mark the sequence dim dynamic, as AutoSP does. Every measurement starts from a reset
Dynamo and an empty inductor cache (``torch._inductor.utils.fresh_cache``; the AOT autograd
cache is off), with one compile thread, so it is a cold compile, after a 1-layer warm-up
compile of each variant (one-time costs of a process's first compile: imports, compiler
probes); the sequence is short, so the first step's time is the compile time. Reported per depth: the first-step seconds of both
(the slower rank's; both ranks compile at the same time), their ratio, and where AutoSP's
extra time goes: its SP pass and its partition step (SAC tagging, PyTorch's min-cut partition
and AutoSP's checks and records, from :attr:`AutoSPBackend.timings`) next to the plain
compile's partition (the same min-cut partition, timed), AOT autograd's tracing of both
(metadata collection and the joint graph, from Dynamo's ``compilation_time_metrics``), and the
full (generation 2) garbage collections that ran during each first step (``gc.callbacks``): each
walks the whole process heap, and AutoSP's backend defers them while it compiles
(``autosp._gc``), a plain ``torch.compile`` does not.

Example (the figures in BENCHMARKS.md)::

    .venv/bin/python benchmarks/compile_time.py --out benchmarks/results/compile_time.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import replace
from typing import Optional

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.partitioners import min_cut_rematerialization_partition
from _common import arguments, finish, llama_config, machine, parser, run_distributed

from autosp.backend import AutoSPBackend
from autosp.models import Llama
from autosp.passes.sac import SACConfig

VARIANTS = ("plain", "autosp")
_PARTITION_METRIC = "min_cut_rematerialization_partition"  # inductor's timer of its partition
_AOT_TRACE = ("aot_collect_metadata", "aot_trace_joint_graph")  # AOT autograd's tracing


class _FullCollections:
    """Seconds and number of full (generation 2) garbage collections in this process while active."""

    def __init__(self) -> None:
        self.seconds, self.count, self._start = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif info["generation"] == 2:
            self.seconds += time.perf_counter() - self._start
            self.count += 1

    def __enter__(self) -> "_FullCollections":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


class _TimedPlain:
    """torch's ``aot_eager`` backend (AOT autograd, min-cut partition, no-op compilers) with its
    partition timed; ``inductor`` times its own."""

    def __init__(self) -> None:
        self.partition_s = 0.0

    def partition(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return min_cut_rematerialization_partition(*args, **kwargs)
        finally:
            self.partition_s += time.perf_counter() - t

    def __call__(self, gm, example_inputs):
        return aot_autograd(
            fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=self.partition, keep_inference_input_mutations=True
        )(gm, example_inputs)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(__doc__, model=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=256))
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--backends", nargs="+", choices=["aot_eager", "inductor"], default=["aot_eager", "inductor"])
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument(
        "--reps", type=int, default=2,
        help="measurements per variant and depth (mean); the variant compiled first alternates, so keep it even",
    )
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.seq_len % 2:
        p.error("--seq-len must be even (sp=2)")
    return args



def _first_step(model: torch.nn.Module, backend, ids: torch.Tensor, labels: torch.Tensor) -> float:
    def step(a, b):
        logits = model(a)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), b.view(-1))

    compiled = torch.compile(step, backend=backend)
    dist.barrier()
    t = time.perf_counter()
    compiled(ids, labels).backward()
    dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the job's first step ends with its slower rank
    return float(dt)


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch._inductor.config.compile_threads = 1
    torch._functorch.config.enable_autograd_cache = False
    group = dist.group.WORLD.group_name
    base = llama_config(args, max_seq_len=args.seq_len)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, base.vocab_size, (1, args.seq_len), generator=g)
    labels = torch.randint(0, base.vocab_size, (1, args.seq_len), generator=g)
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.mark_dynamic(labels, 1)
    out: dict = {"args": arguments(args), "machine": machine(), "runs": {}}

    def measure(name: str, variant: str, depth: int) -> tuple[float, object]:
        torch._dynamo.reset()
        torch._dynamo.utils.compilation_time_metrics.clear()
        torch.manual_seed(0)
        model = Llama(replace(base, n_layers=depth))
        if variant == "autosp":
            backend = AutoSPBackend(sp_size=world, sp_rank=rank, group_name=group, backend=name, sac=SACConfig())
        else:
            backend = _TimedPlain() if name == "aot_eager" else name
        with torch._inductor.utils.fresh_cache(), _FullCollections() as full_gc:
            seconds = _first_step(model, backend, ids, labels)
        return seconds, backend, full_gc

    for name in args.backends:
        for variant in VARIANTS:  # one-time costs of a process's first compile (imports, compiler probes)
            measure(name, variant, 1)
        turn = 0
        for depth in args.layers:
            rows: dict = {variant: [] for variant in VARIANTS}
            for _ in range(args.reps):
                order = VARIANTS if turn % 2 == 0 else VARIANTS[::-1]
                turn += 1
                for variant in order:
                    seconds, backend, full_gc = measure(name, variant, depth)
                    phases = {k: sum(v) for k, v in torch._dynamo.utils.compilation_time_metrics.items()}
                    if variant == "autosp":
                        sp_pass, partition = backend.timings["sp_pass"], backend.timings["partition"]
                    else:
                        sp_pass = 0.0
                        partition = backend.partition_s if name == "aot_eager" else phases.get(_PARTITION_METRIC, 0.0)
                    rows[variant].append({
                        "first_step_s": seconds, "sp_pass_s": sp_pass, "partition_s": partition,
                        "aot_trace_s": sum(phases.get(k, 0.0) for k in _AOT_TRACE), "full_gc_s": full_gc.seconds,
                        "full_gcs": full_gc.count, "phases": phases, "first": order[0],
                    })
                    if rank == 0:
                        print(f"{name} {depth} layers {variant}: {seconds:.1f}s", flush=True)
            row = {}
            for variant, measured in rows.items():  # the mean of the measurements, every column
                keys = {k for m in measured for k in m["phases"]}
                row[variant] = {
                    **{k: statistics.fmean(m[k] for m in measured) for k in ("first_step_s", "sp_pass_s", "partition_s", "aot_trace_s", "full_gc_s", "full_gcs")},
                    "phases": {k: statistics.fmean(m["phases"].get(k, 0.0) for m in measured) for k in keys},
                    "all_first_step_s": [m["first_step_s"] for m in measured],
                    "first": [m["first"] for m in measured],
                }
            out["runs"].setdefault(name, {})[depth] = row
    return out


def markdown(res: dict) -> str:
    a = res["args"]
    reps = f", mean of {a['reps']} measurements" if a.get("reps", 1) > 1 else ""
    lines = [
        f"First training step (compile + one forward/backward of {a['seq_len']} tokens) of a Llama with dim={a['dim']}, "
        f"{a['n_heads']} heads, vocabulary {a['vocab_size']}; 2 processes on CPU ({res['machine']}), the slower rank's "
        "time, cold caches, one compile thread, each backend in processes of its own, the variant compiled first "
        f"alternating{reps}; the breakdown columns are rank 0's.",
        "",
        "| backend | layers | plain torch.compile s | AutoSP s | AutoSP / plain | AutoSP: SP pass s | "
        "partition s, plain / AutoSP (SAC tags, checks, records) | AOT tracing s, plain / AutoSP | "
        "full garbage collections s (mean count), plain / AutoSP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in res["runs"].items():
        for depth, row in runs.items():
            p, s = row["plain"], row["autosp"]
            lines.append(
                f"| {name} | {depth} | {p['first_step_s']:.1f} | {s['first_step_s']:.1f} | "
                f"{s['first_step_s'] / p['first_step_s']:.2f}x | {s['sp_pass_s']:.2f} | {p['partition_s']:.2f} / "
                f"{s['partition_s']:.2f} | {p['aot_trace_s']:.1f} / {s['aot_trace_s']:.1f} | {_full_gc(p)} / {_full_gc(s)} |"
            )
    return "\n".join(lines)


def _full_gc(row: dict) -> str:
    return f"{row['full_gc_s']:.1f} ({row['full_gcs']:.1f})" if "full_gc_s" in row else "-"


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    res: dict = {"runs": {}, "wall_s": 0.0}
    for name in args.backends:  # a fresh pair of processes per backend
        part = run_distributed(run, 2, argparse.Namespace(**{**vars(args), "backends": [name]}), threads=1)
        res.update({k: v for k, v in part.items() if k not in ("runs", "wall_s")})
        res["runs"].update(part["runs"])
        res["wall_s"] += part["wall_s"]
    res["args"] = arguments(args)
    return finish(res, args, markdown)


if __name__ == "__main__":
    main()
