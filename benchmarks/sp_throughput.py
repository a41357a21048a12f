"""AutoSP against hand-written Ulysses and plain DDP, side by side in one run (CPU, gloo).

For each process count (``--nprocs``, default 2 and 4) one group of forked processes builds
every variant from the same initial weights and the same batches:

``autosp_sac``        the unmodified Llama compiled by AutoSP (inductor) with SAC
``autosp``            the same without SAC (PyTorch's min-cut partition)
``ulysses_compiled``  hand-written Ulysses: the Llama changed by hand to call DeepSpeed's
                      ``DistributedAttention`` (``benchmarks/ulysses_baseline.py``; without
                      DeepSpeed, the same algorithm on torch's functional all-to-all), under
                      a plain ``torch.compile`` (inductor)
``ulysses_eager``     the same in eager mode, the way DeepSpeed-Ulysses runs
``ddp_compiled``      no SP: every process trains on a whole sequence (its own sample),
                      plain ``torch.compile``; the memory baseline
``autosp_sac_fsdp``   ``autosp_sac`` with the parameters sharded over the processes
                      (``AutoSPStrategy(fsdp=True)``: gathered in the step, gradients
                      reduce-scattered); not in the default set - compare it with
                      ``--variants autosp_sac autosp_sac_fsdp``

One step is forward, backward, gradient all-reduce and an SGD update. After one untimed round,
every variant's step is timed ``--reps`` times in rounds: each round runs every variant once,
each round starting one variant later than the last (so that no variant always follows the
same one), the slower rank counts. Reported per variant: the median step time, tokens/s (tokens
of the whole group per step / median step time), and its speed against compiled hand-written
Ulysses as the median (and range) of the per-round ratios - the two steps of a round run next to
each other, so a slow minute of the machine slows both. The SP variants ``autosp_sac``,
``autosp`` and ``ulysses_compiled`` are timed the same way at a second, longer length
(``--long-seq-len``, ``--long-reps`` rounds; 0 skips it). Also reported: the bytes
autograd keeps for backward per rank (``saved_tensors_hooks``), the peak resident memory a
step adds per process (high-water mark, glibc set to return large frees at once), and the
longest sequence whose step stays within ``--budget-mib`` per process, found by doubling
from ``--search-start`` (and, as doubling only resolves a factor of 2, the length at which
the peak reaches the budget, interpolated between the two measured lengths around it). The gradients of the first step of every SP variant are compared
with the eager hand-written baseline (they must agree).

Example (the figures in BENCHMARKS.md)::

    .venv/bin/python benchmarks/sp_throughput.py --out benchmarks/results/sp_throughput.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Callable, Optional

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    MiB, PeakRSS, SavedBytes, arguments, finish, init_worker, launch, llama_config, machine, parser, plot_panels, ratio,
)
from ulysses_baseline import default_impl, init_deepspeed, local_shard, ulysses_loss, ulyssesify

from autosp.backend import AutoSPBackend
from autosp.models import Llama, LlamaConfig
from autosp.modes.sharded.config import ShardingPolicy
from autosp.modes.sharded.params import shard_module
from autosp.modes.sharded.values import whole
from autosp.passes.sac import SACConfig

VARIANTS = ("autosp_sac", "autosp", "ulysses_compiled", "ulysses_eager", "ddp_compiled", "autosp_sac_fsdp")
DEFAULT_VARIANTS = VARIANTS[:5]
SP_VARIANTS = (*VARIANTS[:4], "autosp_sac_fsdp")
REFERENCE = "ulysses_eager"
#: the variant every speed ratio is taken against, and those timed at ``--long-seq-len``
COMPILED_REFERENCE = "ulysses_compiled"
LONG_VARIANTS = ("autosp_sac", "autosp", COMPILED_REFERENCE)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(
        __doc__, plot="peak memory against sequence length", threads=True,
        model=dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768, vocab_size=512),
    )
    p.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length of the timed steps")
    p.add_argument("--reps", type=int, default=9, help="timed rounds (one step per variant each)")
    p.add_argument(
        "--long-seq-len", type=int, default=16384,
        help=f"a second timed length for {', '.join(LONG_VARIANTS)} (0: skip)",
    )
    p.add_argument("--long-reps", type=int, default=5, help="timed rounds at --long-seq-len")
    p.add_argument("--budget-mib", type=float, default=384.0, help="memory budget per process for the length search")
    p.add_argument("--search-start", type=int, default=1024)
    p.add_argument("--search-max", type=int, default=65536)
    p.add_argument(
        "--ulysses-impl", choices=["deepspeed", "funcol"], default=default_impl(),
        help="hand-written baseline: DeepSpeed's DistributedAttention (default when installed) or our own",
    )
    args = p.parse_args(argv)
    for n in args.nprocs:
        for S in (args.seq_len, args.search_start, args.long_seq_len):
            if S % n:
                p.error(f"--seq-len/--search-start/--long-seq-len {S} must be divisible by every --nprocs value ({n})")
        if args.n_kv_heads % n or args.n_heads % n:
            p.error(f"--n-heads and --n-kv-heads must be divisible by every --nprocs value ({n})")
    if args.reps < 1 or args.long_reps < 1:
        p.error("--reps and --long-reps must be >= 1")
    if args.long_seq_len < 0:
        p.error("--long-seq-len must be >= 0 (0 skips the second length)")
    return args


class Variant:
    """One way of training the model: its own copy of the weights, optimizer and step."""

    def __init__(self, name: str, cfg: LlamaConfig, rank: int, world: int, impl: str, backend: str = "inductor") -> None:
        """``backend``: what compiles the compiled variants (the benchmark times inductor's code;
        a test that counts what each variant sends may compile faster with ``"aot_eager"``)."""
        self.name, self.rank, self.world = name, rank, world
        torch.manual_seed(0)
        self.model = Llama(cfg)
        self.sp = name in SP_VARIANTS
        self.sharded = name == "autosp_sac_fsdp"
        group = dist.group.WORLD
        if self.sharded:
            from torch.distributed.device_mesh import DeviceMesh

            shard_module(self.model, ShardingPolicy(DeviceMesh.from_group(group, "cpu")))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)

        def full_loss(ids, labels, model=self.model):
            logits = model(ids)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))

        self.fn: Callable
        if name.startswith("autosp"):
            sac = SACConfig() if name.startswith("autosp_sac") else None
            autosp = AutoSPBackend(sp_size=world, sp_rank=rank, group_name=group.group_name, backend=backend, sac=sac)
            self.fn = torch.compile(full_loss, backend=autosp)
        elif name.startswith("ulysses"):
            ulyssesify(self.model, group, impl)
            self.fn = ulysses_loss if name == "ulysses_eager" else torch.compile(ulysses_loss, backend=backend)
        else:
            self.fn = torch.compile(full_loss, backend=backend)

    def inputs(self, S: int, seed: int) -> tuple:
        """SP variants share one sample (sample 0); plain DDP gives each rank its own."""
        g = torch.Generator().manual_seed(seed * 1000 + (0 if self.sp else self.rank))
        ids = torch.randint(0, self.model.config.vocab_size, (1, S), generator=g)
        labels = torch.randint(0, self.model.config.vocab_size, (1, S), generator=g)
        if self.name.startswith("ulysses"):
            ids, labels, pos = local_shard(ids, labels, self.rank, self.world)
            args: tuple = (self.model, ids, labels, pos, self.world)
            tensors = (ids, labels, pos)
        else:
            args = tensors = (ids, labels)
        if self.name != "ulysses_eager":
            for t in tensors:
                torch._dynamo.mark_dynamic(t, 1)  # one graph for every length
        return args

    def step(self, args: tuple, saved: Optional[SavedBytes] = None) -> float:
        self.model.zero_grad(set_to_none=True)
        if saved is None:
            loss = self.fn(*args)
        else:
            with saved.hooks():
                loss = self.fn(*args)
        loss.backward()
        if self.sharded:  # the reduce-scatter in backward left each rank its averaged shard gradient
            self.opt.step()
            return float(loss.detach())
        grads = [p.grad for p in self.model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # hand-written Ulysses: the sum over the SP group is the gradient
        if not self.name.startswith("ulysses"):
            flat /= self.world  # AutoSP and DDP: the mean over ranks (AutoSP's per-rank grads carry the SP factor)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        self.opt.step()
        return float(loss.detach())

    def tokens_per_step(self, S: int) -> int:
        return S if self.sp else S * self.world


def timed_rounds(variants: dict, S: int, reps: int) -> dict:
    """Time one step of every variant per round at length ``S``, after one untimed round; round
    ``i`` starts with variant ``i mod n``. Per variant: the step times, their median, tokens/s
    and, when :data:`COMPILED_REFERENCE` ran too, the per-round speed ratios against it."""
    names = list(variants)
    times: dict = {name: [] for name in names}
    for rep in range(-1, reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            v = variants[name]
            batch = v.inputs(S, 1 + rep if rep >= 0 else 500)
            dist.barrier()
            t = time.perf_counter()
            v.step(batch)
            elapsed = max_over_ranks(time.perf_counter() - t)
            if rep >= 0:
                times[name].append(elapsed)
    out = {}
    for name, v in variants.items():
        step_s = statistics.median(times[name])
        out[name] = {"times": times[name], "step_s": step_s, "tokens_per_s": v.tokens_per_step(S) / step_s, "seq_len": S}
        if COMPILED_REFERENCE in times:  # tokens/s ratio of one round = the inverse ratio of its step times
            ref = times[COMPILED_REFERENCE]
            speed = [(r / t) * v.tokens_per_step(S) / variants[COMPILED_REFERENCE].tokens_per_step(S) for r, t in zip(ref, times[name])]
            out[name]["vs_compiled"] = speed
    return out


def vs_compiled(r: dict, ref: Optional[dict]) -> str:
    """The median and range of the per-round speed ratios against compiled hand-written Ulysses
    where the rounds were recorded, else the ratio of tokens/s (older results)."""
    speed = r.get("vs_compiled")
    if speed:
        return f"{statistics.median(speed):.2f}x ({min(speed):.2f}-{max(speed):.2f})"
    return ratio(r["tokens_per_s"], ref["tokens_per_s"]) if ref else "-"


_ITEMSIZE = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}


def all_to_all_bytes(v: Variant, batch: tuple) -> int:
    """The bytes of the send buffers this rank passes to ``all_to_all_single`` in one step
    (``c10d::alltoall_base_`` in the profiler, its input tensor: the pieces for every rank,
    this rank's own included), whichever code called it: AutoSP's ops, DeepSpeed, funcol."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        v.step(batch)
    total = 0
    for e in prof.events():
        if e.name == "c10d::alltoall_base_":
            shape, dtype = e.input_shapes[1], e.input_dtypes[1]
            total += math.prod(shape) * _ITEMSIZE[dtype]
    return total


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def worker(rank: int, world: int, port: int, out_dir: str, args: argparse.Namespace) -> None:
    init_worker(rank, world, port, args.threads)
    try:
        result = run(rank, world, args)
        if rank == 0:
            torch.save(result, os.path.join(out_dir, "result.pt"))
    finally:
        dist.destroy_process_group()


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    cfg = llama_config(args, max_seq_len=args.search_max)
    say = print if rank == 0 else (lambda *a, **k: None)
    impl = args.ulysses_impl
    version = init_deepspeed() if impl == "deepspeed" and any(n.startswith("ulysses") for n in args.variants) else None
    variants = {name: Variant(name, cfg, rank, world, impl) for name in args.variants}
    res: dict = {name: {"times": []} for name in variants}
    ulysses = f"DeepSpeed {version} DistributedAttention" if version else "own functional all-to-all (DeepSpeed not used)"
    S = args.seq_len

    # first step: compile, and the gradients every SP variant must agree on
    grads = {}
    for name, v in variants.items():
        t = time.perf_counter()
        v.step(v.inputs(S, 0))
        res[name]["first_step_s"] = max_over_ranks(time.perf_counter() - t)
        grads[name] = torch.cat([whole(p.grad).reshape(-1) for p in v.model.parameters()])  # (a DTensor's whole)
        say(f"[{world} procs] {name}: first step (compile) {res[name]['first_step_s']:.1f}s", flush=True)
    if REFERENCE in grads:
        ref = grads[REFERENCE]
        for name in variants:
            if variants[name].sp:
                res[name]["grad_rel_diff"] = max_over_ranks(float((grads[name] - ref).norm() / ref.norm()))

    # timed steps, variants interleaved
    res_timed = timed_rounds(variants, S, args.reps)
    for name in variants:
        res[name].update(res_timed[name])
    long_variants = {name: v for name, v in variants.items() if name in LONG_VARIANTS}
    if args.long_seq_len and long_variants:
        say(f"[{world} procs] timing {', '.join(long_variants)} at S={args.long_seq_len}", flush=True)
        for name, timed in timed_rounds(long_variants, args.long_seq_len, args.long_reps).items():
            res[name]["long"] = timed

    # bytes every rank hands to all-to-alls in one step (forward and backward), from the profiler
    for name, v in variants.items():
        if v.sp:
            res[name]["all_to_all_bytes"] = max_over_ranks(all_to_all_bytes(v, v.inputs(S, 99)))

    # memory at the timed length: what autograd keeps, and the peak a step adds
    probe = PeakRSS()
    for name, v in variants.items():
        batch = v.inputs(S, 100)
        saved = SavedBytes([*v.model.parameters(), *v.model.buffers(), *(t for t in batch if isinstance(t, torch.Tensor))])
        v.step(batch, saved)
        res[name]["saved_bytes"] = max_over_ranks(saved.total)
        batch = v.inputs(S, 101)
        v.model.zero_grad(set_to_none=True)  # freed before the probe starts: the step allocates them anew
        probe.start()
        v.step(batch)
        res[name]["peak_bytes"] = max_over_ranks(probe.stop())

    # the longest sequence within the budget, by doubling
    budget = args.budget_mib * MiB
    for name, v in variants.items():
        peaks, longest, L, over = {}, 0, args.search_start, False
        while L <= args.search_max:
            batch = v.inputs(L, 200)
            v.model.zero_grad(set_to_none=True)
            probe.start()
            v.step(batch)
            peaks[L] = max_over_ranks(probe.stop())
            say(f"[{world} procs] {name}: S={L} peak {peaks[L] / MiB:.0f} MiB", flush=True)
            if peaks[L] > budget:
                over = True
                break
            longest, L = L, 2 * L
        res[name].update(search_peaks=peaks, longest=longest, capped=not over)
    return {"ulysses": ulysses, "variants": res}


#: the memory-model variant (``autosp/memory/model.py``) that predicts each measured one
MODEL_OF = {"autosp_sac": "sp_sac", "autosp": "sp", "ulysses_eager": "ulysses_eager", "ddp_compiled": "no_sp"}


def add_predictions(results: dict) -> None:
    """The memory model's saved bytes per rank for each variant and process count, traced
    for this run's model and timed length (fp32): the measured column checks the model."""
    from autosp.memory import model as mm

    a = results["args"]
    cfg = llama_config(a, max_seq_len=a["search_max"])
    S = a["seq_len"]
    for n, run_ in results["runs"].items():
        for name, r in run_["variants"].items():
            if name in MODEL_OF:
                r["predicted_saved_bytes"] = mm.trace(cfg, MODEL_OF[name], int(n), torch.float32, S, native_gqa=None).memory(S)["saved"]


def at_budget(r: dict, budget_mib: float) -> Optional[float]:
    """The length at which the step peak reaches the budget, interpolated linearly between
    the last measured length that fit and the first that did not (None if none failed)."""
    peaks = {int(k): v for k, v in r["search_peaks"].items()}
    budget = budget_mib * MiB
    over = [S for S in sorted(peaks) if peaks[S] > budget]
    if not over or over[0] == min(peaks):
        return None
    hi = over[0]
    lo = max(S for S in peaks if S < hi)
    return lo + (budget - peaks[lo]) * (hi - lo) / (peaks[hi] - peaks[lo])


def markdown(results: dict) -> str:
    args = results["args"]
    lines = [
        f"Llama dim={args['dim']} layers={args['n_layers']} heads={args['n_heads']} kv_heads={args['n_kv_heads']} "
        f"ffn={args['ffn_hidden']} vocab={args['vocab_size']}, batch 1, fp32, {args['threads']} thread per process, "
        f"gloo; timed at S={args['seq_len']} in {args['reps']} rounds (one step of every variant each; step time: the "
        f"median; speed against compiled hand-written Ulysses: the median and range of the per-round ratios); budget "
        f"{args['budget_mib']:.0f} MiB per process for the longest-sequence search (doubling from {args['search_start']}).",
        "",
    ]
    for n, run_ in results["runs"].items():
        res = run_["variants"]
        ref_c, ref_e = res.get("ulysses_compiled"), res.get("ulysses_eager")
        lines += [
            f"**{n} processes** (SP variants: sp={n}; `ddp_compiled`: {n} data-parallel ranks, one whole sequence each; "
            f"hand-written Ulysses: {run_['ulysses']})",
            "",
            "| variant | step s | tokens/s | vs hand-written compiled (range) | vs hand-written eager | all-to-all MiB/rank/step "
            "| saved for backward MiB/rank (memory model) | step peak MiB/process | longest S within budget (doubling) | "
            "S at budget, interpolated | grad rel. diff vs hand-written |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in res.items():
            longest = f"{'>= ' if r['capped'] else ''}{r['longest'] or '< ' + str(args['search_start'])}"
            interp = at_budget(r, args["budget_mib"])
            interp = f"{interp:.0f}" if interp else "-"
            diff = f"{r['grad_rel_diff']:.1e}" if "grad_rel_diff" in r else "-"
            pred = f" ({r['predicted_saved_bytes'] / MiB:.1f})" if "predicted_saved_bytes" in r else ""
            a2a = f"{r['all_to_all_bytes'] / MiB:.1f}" if "all_to_all_bytes" in r else "-"
            lines.append(
                f"| {name} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | "
                f"{vs_compiled(r, ref_c)} | "
                f"{ratio(r['tokens_per_s'], ref_e['tokens_per_s']) if ref_e else '-'} | {a2a} | {r['saved_bytes'] / MiB:.1f}{pred} | "
                f"{r['peak_bytes'] / MiB:.1f} | {longest} | {interp} | {diff} |"
            )
        long = {name: r["long"] for name, r in res.items() if "long" in r}
        if long:
            L = next(iter(long.values()))["seq_len"]
            lines += [
                "",
                f"At S={L} ({args.get('long_reps')} rounds, the same processes):",
                "",
                "| variant | step s | tokens/s | vs hand-written compiled (range) |",
                "|---|---|---|---|",
            ]
            for name, r in long.items():
                lines.append(f"| {name} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {vs_compiled(r, long.get(COMPILED_REFERENCE))} |")
        if "autosp_sac" in res and "autosp_sac_fsdp" in res:
            sharded, replicated = res["autosp_sac_fsdp"], res["autosp_sac"]
            lines += [
                "",
                f"Sharded (`fsdp=True`) / replicated AutoSP + SAC: tokens/s "
                f"{ratio(sharded['tokens_per_s'], replicated['tokens_per_s'])}, step peak "
                f"{ratio(sharded['peak_bytes'], replicated['peak_bytes'])}.",
            ]
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    panels = {
        f"{n} processes (CPU, gloo)": {
            name: (sorted(peaks), [peaks[k] / MiB for k in sorted(peaks)])
            for name, r in run_["variants"].items()
            for peaks in [{int(k): v for k, v in r["search_peaks"].items()}]  # JSON keys are strings
        }
        for n, run_ in results["runs"].items()
    }
    plot_panels(panels, path, "step peak MiB per process", (results["args"]["budget_mib"], "budget"))


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    t = time.perf_counter()
    runs = {}
    for n in args.nprocs:
        runs[n] = launch(worker, n, args)
    results = {"args": arguments(args), "machine": machine(), "runs": runs, "wall_s": time.perf_counter() - t}
    add_predictions(results)
    return finish(results, args, markdown, plot)


if __name__ == "__main__":
    main()
