"""Save and load time, and bytes written per rank, of a checkpoint (model + AdamW state) in the
replicated mode (``fsdp=False``: rank 0 writes one file, every rank reads it) and the sharded
mode (``fsdp=True``: a torch distributed checkpoint, every rank writes its shards and reads its
slice), side by side in one run
(CPU, gloo, ``--nprocs`` processes, the files on local disk).

The model is a scaled-down stand-in for Llama-3.2-1B: its width (dim 1024 here against 2048)
and vocabulary are kept smaller so that ``--nprocs`` replicas and their AdamW state fit this
machine; the per-parameter costs scale with the parameter count. What each mode runs is what
``AutoSPStrategy`` runs: ``torch.save`` of Lightning's checkpoint dict on rank 0 and
``load_state_dict`` on every rank, or ``autosp.checkpoint.save_distributed`` and
``load_distributed`` (DCP, with the DTensor parameters of ``autosp.modes.sharded.params.shard_module``). Times are the median of ``--reps`` rounds,
each from a barrier to a barrier (the slowest rank); the page cache is warm after the first
round, as on a node that reads back what it wrote.

Example::

    .venv/bin/python benchmarks/checkpoint_io.py --nprocs 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.distributed as dist
from _common import arguments, finish, init_worker, launch, llama_config, median_seconds, parser

from autosp.checkpoint import META_FILE, load_distributed, save_distributed
from autosp.models import Llama
from autosp.modes.sharded.config import ShardingPolicy
from autosp.modes.sharded.params import shard_module


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(__doc__, model=dict(dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn_hidden=4096, vocab_size=32000))
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--reps", type=int, default=3, help="timed rounds of each (median)")
    p.add_argument("--dir", type=str, default=None, help="where to write the checkpoints (default: a temporary directory)")
    return p.parse_args(argv)


def _model_and_optimizer(args: argparse.Namespace, sharded: bool):
    torch.manual_seed(0)
    model = Llama(llama_config(args, max_seq_len=64))
    if sharded:
        from torch.distributed.device_mesh import DeviceMesh

        shard_module(model, ShardingPolicy(DeviceMesh.from_group(dist.group.WORLD, "cpu")))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the moments
    return model, optimizer


def worker(rank: int, world: int, port: int, out_dir: str, args: argparse.Namespace, where: str) -> None:
    init_worker(rank, world, port, 1)
    try:
        rows = {}
        params = 0
        # replicated: Lightning's DDP path (rank 0 writes, every rank reads the whole file)
        model, optimizer = _model_and_optimizer(args, sharded=False)
        params = sum(p.numel() for p in model.parameters())
        path = Path(where) / "replicated.ckpt"

        def save_replicated():
            if rank == 0:
                torch.save({"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}, path)

        def load_replicated():
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
            model.load_state_dict(checkpoint["state_dict"])
            optimizer.load_state_dict(checkpoint["optimizer_states"][0])

        save_s = median_seconds(save_replicated, args.reps, dist.barrier, dist.barrier)
        load_s = median_seconds(load_replicated, args.reps, dist.barrier, dist.barrier)
        written = [path.stat().st_size if r == 0 else 0 for r in range(world)]
        rows["replicated"] = {"save_s": save_s, "load_s": load_s, "bytes_per_rank": written}
        del model, optimizer

        # sharded: a torch distributed checkpoint, each rank writes its shards and reads its slice
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        model, optimizer = _model_and_optimizer(args, sharded=True)
        path = Path(where) / "sharded.ckpt"

        def save():
            checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [get_optimizer_state_dict(model, optimizer)]}
            save_distributed(checkpoint, path, rank=rank, barrier=lambda name: dist.barrier())

        def load():
            load_distributed(path, model, [optimizer])

        save_s = median_seconds(save, args.reps, dist.barrier, dist.barrier)
        load_s = median_seconds(load, args.reps, dist.barrier, dist.barrier)
        written = [(path / f"__{r}_0.distcp").stat().st_size + ((path / META_FILE).stat().st_size + (path / ".metadata").stat().st_size if r == 0 else 0) for r in range(world)]
        rows["sharded"] = {"save_s": save_s, "load_s": load_s, "bytes_per_rank": written}
        if rank == 0:
            torch.save({"args": arguments(args), "params": params, "rows": rows}, os.path.join(out_dir, "result.pt"))
    finally:
        dist.destroy_process_group()


def markdown(results: dict) -> str:
    a, rows = results["args"], results["rows"]
    rep, sh = rows["replicated"], rows["sharded"]
    lines = [
        f"{a['nprocs']} processes, Llama stand-in dim={a['dim']} layers={a['n_layers']} vocab={a['vocab_size']} "
        f"({results['params'] / 1e6:.0f}M parameters, fp32, AdamW), median of {a['reps']} rounds.",
        "",
        "| mode | save s | load s | bytes written, largest rank | bytes written, all ranks |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['save_s']:.2f} | {r['load_s']:.2f} | {max(r['bytes_per_rank']) / 1e6:.0f} MB | {sum(r['bytes_per_rank']) / 1e6:.0f} MB |")
    lines += [
        "",
        f"Sharded over replicated: save time {sh['save_s'] / rep['save_s']:.2f}x, load time {sh['load_s'] / rep['load_s']:.2f}x, "
        f"largest rank's bytes {max(sh['bytes_per_rank']) / max(rep['bytes_per_rank']):.2f}x.",
    ]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    where = tempfile.mkdtemp(dir=args.dir)
    try:
        return finish(launch(worker, args.nprocs, args, where), args, markdown)
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
