"""The cost of the per-step SP batch check (``autosp.batch_agreement``) next to the
training step it guards, side by side in one run (CPU, gloo, ``--nprocs`` processes, one SP
group).

Before every step AutoSP fingerprints the batch (a position-weighted float64 sum per tensor)
and all-gathers 4 numbers per rank over the SP group. Measured per batch of ``[batch, S]``
token ids and labels: the check, its fingerprint alone, and a compiled AutoSP step (forward,
backward) of a small Llama on the same batch; reported as milliseconds and as the check's
share of the step.

Example::

    .venv/bin/python benchmarks/batch_check.py --seq-lens 1024 8192
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import arguments, finish, init_worker, launch, llama_config, median_seconds, parser

from autosp.backend import AutoSPBackend
from autosp.batch_agreement import batch_fingerprint, check_sp_batch_agreement
from autosp.models import Llama
from autosp.passes.sac import SACConfig


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(__doc__, threads=True, model=dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=256, vocab_size=512))
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--reps", type=int, default=20, help="timed calls of each (median)")
    args = p.parse_args(argv)
    if any(S % args.nprocs for S in args.seq_lens):
        p.error("every --seq-lens value must be divisible by --nprocs")
    return args


def worker(rank: int, world: int, port: int, out_dir: str, args: argparse.Namespace) -> None:
    init_worker(rank, world, port, args.threads)
    try:
        group = dist.group.WORLD
        torch.manual_seed(0)
        model = Llama(llama_config(args, max_seq_len=max(args.seq_lens)))
        backend = AutoSPBackend(sp_size=world, sp_rank=rank, group_name=group.group_name, backend="inductor", sac=SACConfig())

        def loss_fn(ids, labels):
            logits = model(ids)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))

        step = torch.compile(loss_fn, backend=backend)
        cpu = torch.device("cpu")
        rows = {}
        for S in args.seq_lens:
            g = torch.Generator().manual_seed(S)
            ids = torch.randint(0, args.vocab_size, (args.batch, S), generator=g)
            labels = torch.randint(0, args.vocab_size, (args.batch, S), generator=g)
            for t in (ids, labels):
                torch._dynamo.mark_dynamic(t, 1)
            step(ids, labels).backward()  # compile
            rows[S] = {
                "check_ms": 1e3 * median_seconds(lambda: check_sp_batch_agreement([ids, labels], group, world, cpu, "bench"), args.reps, dist.barrier),
                "fingerprint_ms": 1e3 * median_seconds(lambda: batch_fingerprint([ids, labels], cpu), args.reps, dist.barrier),
                "step_ms": 1e3 * median_seconds(lambda: step(ids, labels).backward(), max(3, args.reps // 4), dist.barrier),
            }
        if rank == 0:
            torch.save({"args": arguments(args), "rows": rows}, os.path.join(out_dir, "result.pt"))
    finally:
        dist.destroy_process_group()


def markdown(results: dict) -> str:
    a = results["args"]
    lines = [
        f"{a['nprocs']} processes (one SP group), batch {a['batch']}, Llama dim={a['dim']} layers={a['n_layers']}, "
        f"inductor + SAC, median of {a['reps']} calls.",
        "",
        "| S | batch check ms | of which fingerprint ms | AutoSP step ms (fwd+bwd) | check / step |",
        "|---|---|---|---|---|",
    ]
    for S, r in results["rows"].items():
        lines.append(
            f"| {S} | {r['check_ms']:.2f} | {r['fingerprint_ms']:.2f} | {r['step_ms']:.0f} | "
            f"{100 * r['check_ms'] / r['step_ms']:.2f}% |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    return finish(launch(worker, args.nprocs, args), args, markdown)


if __name__ == "__main__":
    main()
