"""The sharded mode (``AutoSPStrategy(fsdp=...)``) on CPU/gloo, measured side by side in one run
per part (``--nprocs`` forked processes, sp = the process count; resident memory read from the
kernel's high-water mark with glibc returning large frees at once, the slower rank counts).

1. **Working set of a training step** (forward + backward, SAC on, aot_eager) of a
   parameter-dominated Llama (``--dim 2048 --n-layers 8``, a short sequence): how much a step
   adds to a rank's memory above its start, sharded with the collectives bucketed per block,
   sharded without bucketing, and replicated, next to the sizes that bound it - the whole
   model, one block, the rank's shards. A sharded step must stay within its gradient shards +
   about two blocks of gathered weights (and one block's unreduced gradients) + activations,
   never the whole model.
2. **Collectives per step and bytes all-gathered**: the parameter all-gathers and
   reduce-scatters of the compiled graphs before and after bucketing (``bucket_stats``), the
   collective calls the profiler counts in one step, and the bytes gathered per step in fp32
   and under ``bf16-mixed`` (parameters gathered in bfloat16).
3. **Building a sharded model from meta**: the peak a rank adds while its model gets its
   values - read from pretrained weights (a ``.safetensors`` file written here), each rank its
   rows, against loading the whole file and sharding it; and initialised by the model's own
   initialisers unit by unit (every block initialises itself) against a model whose root
   initialiser makes the whole model one unit.

Example::

    .venv/bin/python benchmarks/sharded_mode.py --out benchmarks/results/sharded_mode.json
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
from typing import Optional

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _common import MiB, PeakRSS, arguments, finish, llama_config, parser, run_distributed

from autosp.backend import AutoSPBackend
from autosp.models import Llama, LlamaConfig
from autosp.modes.sharded.config import ShardingPolicy
from autosp.modes.sharded.values import local_tensor
from autosp.modes.sharded.params import shard_module
from autosp.passes.sac import SACConfig
from autosp.modes.sharded.pretrained import load_pretrained
from autosp.modes.sharded.materialize import materialize_sharded

STEP_VARIANTS = ("sharded", "sharded_unbucketed", "replicated", "sharded_bf16")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(__doc__, model=dict(dim=2048, n_layers=8, n_heads=16, n_kv_heads=16, ffn_hidden=5632, vocab_size=1024))
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--init-dim", type=int, default=2048, help="width of the models of part 3")
    p.add_argument("--init-layers", type=int, default=8)
    return p.parse_args(argv)


def _max(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def _collective_calls(fn, *args) -> dict[str, int]:
    """Collective calls of one forward + backward, by c10d op, as the profiler records them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args).backward()
    calls: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("c10d::"):
            calls[e.name] = calls.get(e.name, 0) + 1
    return calls


def step_working_set(rank: int, world: int, args: argparse.Namespace) -> dict:
    """Part 1 and 2: one compiled step per variant, in these processes one after the other."""
    cfg = llama_config(args, max_seq_len=args.seq_len)
    mesh = _mesh()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq_len), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (1, args.seq_len), generator=g)
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.mark_dynamic(labels, 1)
    out: dict = {}
    probe = PeakRSS()
    for name in STEP_VARIANTS:
        torch.manual_seed(0)
        model = Llama(cfg)
        if name == "replicated":
            out["model_bytes"] = _bytes(model.parameters())
            out["block_bytes"] = _bytes(model.layers[0].parameters())
        bf16 = name == "sharded_bf16"
        if name.startswith("sharded"):
            shard_module(model, ShardingPolicy(mesh, torch.bfloat16 if bf16 else None, torch.float32 if bf16 else None))
        backend = AutoSPBackend(
            sp_size=world, sp_rank=rank, group_name=dist.group.WORLD.group_name, backend="aot_eager", sac=SACConfig(),
            bucket_collectives=name != "sharded_unbucketed",
        )
        compiled = torch.compile(lambda a, b, m=model: _loss(m, a, b), backend=backend)

        def fn(a, b, compiled=compiled):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                return compiled(a, b)

        fn(ids, labels).backward()  # compiles
        calls = _collective_calls(fn, ids, labels)
        model.zero_grad(set_to_none=True)  # the step allocates its gradients anew
        probe.start()
        loss = fn(ids, labels)
        forward_peak = probe.stop()
        loss.backward()
        step_peak = probe.stop()
        del loss
        stats = backend.bucket_stats
        out[name] = {
            "forward_peak": _max(forward_peak), "step_peak": _max(step_peak),
            "shard_bytes": _max(_bytes([local_tensor(p) for p in model.parameters()])),
            "grad_bytes": _max(_bytes([local_tensor(p.grad) for p in model.parameters() if p.grad is not None])),
            "collective_calls": calls,
            "graph_gathers": sum(s.all_gathers for s in stats), "graph_gather_buckets": sum(s.gather_buckets for s in stats),
            "graph_scatters": sum(s.reduce_scatters for s in stats), "graph_scatter_buckets": sum(s.scatter_buckets for s in stats),
            "gathered_bytes": sum(s.gathered_bytes for s in stats), "scattered_bytes": sum(s.scattered_bytes for s in stats),
            "gather_dtypes": sorted({d for s in stats for d in s.gather_dtypes}),
        }
        if rank == 0:
            print(f"[{world} procs] {name}: step adds {step_peak / MiB:.0f} MiB (forward {forward_peak / MiB:.0f})", flush=True)
        del model, compiled, fn, backend
        torch._dynamo.reset()
        gc.collect()
    return out


class _Block(nn.Module):
    """An MLP block with its own initialiser."""

    def __init__(self, dim: int, own_init: bool):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)
        if own_init:
            self.reset_parameters = self._init  # type: ignore[method-assign]

    def _init(self) -> None:
        nn.init.normal_(self.up.weight, std=0.02)
        nn.init.normal_(self.down.weight, std=0.02)


class _Stack(nn.Module):
    """Blocks that initialise themselves (``root_init=False``: one unit each), or the same under
    a root initialiser that overrides them (one unit: the whole model)."""

    def __init__(self, dim: int, layers: int, root_init: bool):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(dim, own_init=not root_init) for _ in range(layers))
        if root_init:
            self.reset_parameters = self._init  # type: ignore[method-assign]

    def _init(self) -> None:
        for block in self.blocks:
            block._init()


def build_from_meta(rank: int, world: int, args: argparse.Namespace) -> dict:
    """Part 3: the peak a rank adds while its model gets its values."""
    mesh = _mesh()
    policy = ShardingPolicy(mesh)
    probe = PeakRSS()
    out: dict = {}
    cfg = LlamaConfig(dim=args.init_dim // 2, n_layers=args.init_layers, n_heads=16, n_kv_heads=4, ffn_hidden=2 * args.init_dim, vocab_size=32000, max_seq_len=64)
    path = os.path.join(args.scratch, "llama.safetensors")
    if rank == 0:
        from safetensors.torch import save_file

        torch.manual_seed(0)
        save_file({k: v.contiguous() for k, v in Llama(cfg).state_dict().items()}, path)
    dist.barrier()
    for name in ("read_per_shard", "load_whole_then_shard"):
        gc.collect()
        probe.start()
        if name == "read_per_shard":
            with torch.device("meta"):
                model = Llama(cfg)
            load_pretrained(model, path, policy, torch.device("cpu"))
        else:
            from safetensors.torch import load_file

            model = Llama(cfg)
            model.load_state_dict(load_file(path))
        shard_module(model, policy)
        gc.collect()
        peak = probe.stop()
        out[name] = {"peak": _max(peak), "shard_bytes": _max(_bytes([local_tensor(p) for p in model.parameters()])), "model_bytes": _bytes(model.parameters())}
        del model
    for name, root_init in (("units", False), ("root_initialiser", True)):
        gc.collect()
        with torch.device("meta"):
            model = _Stack(args.init_dim, args.init_layers, root_init)
        probe.start()
        report = materialize_sharded(model, torch.device("cpu"), policy)
        shard_module(model, policy)
        gc.collect()
        peak = probe.stop()
        out[name] = {
            "peak": _max(peak), "units": report.units, "largest_unit_bytes": report.largest_unit_bytes,
            "model_bytes": report.model_bytes, "shard_bytes": _max(_bytes([local_tensor(p) for p in model.parameters()])),
        }
        del model
    return out


def _mesh():
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.group.WORLD, "cpu")


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    return {"step": step_working_set(rank, world, args), "init": build_from_meta(rank, world, args)}


def markdown(results: dict) -> str:
    a, step, init = results["args"], results["step"], results["init"]
    whole, block = step["model_bytes"], step["block_bytes"]
    sh = step["sharded"]
    bound = sh["grad_bytes"] + 3 * block
    lines = [
        f"{a['nprocs']} processes (sp={a['nprocs']}), Llama dim={a['dim']} layers={a['n_layers']} vocab={a['vocab_size']}, "
        f"S={a['seq_len']}, fp32, SAC, aot_eager. Whole model {whole / MiB:.0f} MiB, one block {block / MiB:.0f} MiB.",
        "",
        "| variant | step adds (MiB) | forward adds (MiB) | shards held (MiB) | gradients (MiB) | all-gathers per step (graphs) | reduce-scatters | collective calls (profiler) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in STEP_VARIANTS:
        r = step[name]
        gathers = f"{r['graph_gathers']} -> {r['graph_gather_buckets']}" if r["graph_gathers"] else "-"
        scatters = f"{r['graph_scatters']} -> {r['graph_scatter_buckets']}" if r["graph_scatters"] else "-"
        lines.append(
            f"| {name} | {r['step_peak'] / MiB:.0f} | {r['forward_peak'] / MiB:.0f} | {r['shard_bytes'] / MiB:.0f} | {r['grad_bytes'] / MiB:.0f} "
            f"| {gathers} | {scatters} | {sum(r['collective_calls'].values())} |"
        )
    bf = step["sharded_bf16"]
    lines += [
        "",
        f"Sharded step: adds {sh['step_peak'] / MiB:.0f} MiB = {sh['step_peak'] / whole:.2f}x the whole model, within its gradient shards "
        f"+ 3 blocks ({bound / MiB:.0f} MiB: {sh['step_peak'] / bound:.2f}x of that); its forward adds {sh['forward_peak'] / block:.1f} blocks' worth. "
        f"Replicated: adds {step['replicated']['step_peak'] / MiB:.0f} MiB and holds the whole model besides.",
        f"All-gathered per step: {sh['gathered_bytes'] / MiB:.0f} MiB in fp32 ({', '.join(sh['gather_dtypes'])}), "
        f"{bf['gathered_bytes'] / MiB:.0f} MiB under bf16-mixed ({', '.join(bf['gather_dtypes'])}): {bf['gathered_bytes'] / sh['gathered_bytes']:.2f}x.",
        "",
        "| building from meta | peak added (MiB) | shard (MiB) | whole model (MiB) | peak / shard |",
        "|---|---|---|---|---|",
    ]
    for name in ("read_per_shard", "load_whole_then_shard", "units", "root_initialiser"):
        r = init[name]
        units = f" ({r['units']} unit(s), largest {r['largest_unit_bytes'] / MiB:.0f} MiB)" if "units" in r else ""
        lines.append(f"| {name}{units} | {r['peak'] / MiB:.0f} | {r['shard_bytes'] / MiB:.0f} | {r['model_bytes'] / MiB:.0f} | {r['peak'] / r['shard_bytes']:.2f}x |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        args.scratch = scratch
        results = run_distributed(run, args.nprocs, args)
    del args.scratch
    results["args"] = arguments(args)
    return finish(results, args, markdown)


if __name__ == "__main__":
    main()
