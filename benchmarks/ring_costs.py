"""What a ring level costs: ``ulysses=2 x ring=2`` against ``ulysses=4`` at the same world and
length, side by side in one run (4 processes on CPU, gloo).

Per rank and training step (forward and backward, AutoSP + SAC, aot_eager): the bytes it sends
to other ranks at each level - the all-to-alls around attention (``exchange``: Ulysses' over the
SP group; with a ring, the one that also moves each rank's positions into its head-tail ring
segment) and the key/value blocks and their gradients passed around the ring (``ring``), counted
by AutoSP's ops (``autosp.ops.collectives.SENT_BYTES``) - the step time (median of interleaved
rounds), the peak resident memory of a step above the level before it, and the bytes autograd
keeps for backward; the largest of the four ranks for each. The losses of the two layouts are
compared too (the same model and batch: equal to rounding).

The bytes follow from the layout: per attention call a Ulysses all-to-all of ``q``, ``k``, ``v``
and the output moves ``1 - 1/U`` of each (``U`` the Ulysses degree) - k and v with the KV heads,
before the model's repeat - and so does each of the four in backward; a ring of ``R`` passes
``R - 1`` key/value blocks forward and, in backward, ``R - 1`` blocks with ``R`` blocks of their
fp32 gradients. On a GPU the ring's sends overlap the block's compute; gloo on CPU runs them
alongside too, but two cores leave little to overlap, so the time here is an upper bound.

    .venv/bin/python benchmarks/ring_costs.py --seq-len 8192 --out benchmarks/results/ring_costs.json
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import MiB, PeakRSS, SavedBytes, arguments, finish, machine, parser, run_distributed

LAYOUTS = {"ulysses=4": (4, 1), "ulysses=2 x ring=2": (2, 2), "ulysses=1 x ring=4": (1, 4)}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(__doc__, model={"vocab_size": 1024, "dim": 256, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 704})
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5, help="timed steps per layout, interleaved")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=["ulysses=4", "ulysses=2 x ring=2"])
    args = p.parse_args(argv)
    if args.seq_len % 4:
        p.error("--seq-len must be divisible by 4 (the world)")
    return args


def _max(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    from _common import llama_config

    from autosp.backend import AutoSPBackend
    from autosp.models import Llama
    from autosp.ops.collectives import SENT_BYTES
    from autosp.passes.sac import SACConfig

    cfg = llama_config(args, max_seq_len=args.seq_len)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq_len), generator=g)
    torch._dynamo.mark_dynamic(ids, 1)
    steps = {}
    for name in args.layouts:
        torch.manual_seed(0)
        model = Llama(cfg)
        backend = AutoSPBackend(
            sp_size=world, sp_rank=rank, group_name=dist.group.WORLD.group_name, backend="aot_eager", sac=SACConfig(),
            sp_layout=LAYOUTS[name],
        )
        fn = torch.compile(lambda a, model=model: F.cross_entropy(model(a[:, :-1]).flatten(0, 1), a[:, 1:].flatten()), backend=backend)
        steps[name] = (model, fn)
    res: dict = {"layouts": {}}

    def step(name: str, saved: Optional[SavedBytes] = None) -> float:
        model, fn = steps[name]
        model.zero_grad(set_to_none=False)
        if saved is None:
            loss = fn(ids)
        else:
            with saved.hooks():
                loss = fn(ids)
        loss.backward()
        return float(loss.detach())

    for name in args.layouts:  # compile, warm up, count bytes and memory once
        model, _ = steps[name]
        step(name)
        before = dict(SENT_BYTES)
        peak = PeakRSS()
        dist.barrier()
        peak.start()
        loss = step(name)
        peak_bytes = peak.stop()
        sent = {k: SENT_BYTES[k] - before[k] for k in SENT_BYTES}
        saved = SavedBytes([*model.parameters(), *model.buffers(), ids])
        step(name, saved)
        res["layouts"][name] = {
            "layout": LAYOUTS[name], "loss": loss, "exchange_bytes": _max(sent["exchange"]), "ring_bytes": _max(sent["ring"]),
            "peak": _max(peak_bytes), "saved": _max(saved.total), "times": [],
        }
    for _ in range(args.rounds):  # interleaved: each round times every layout once
        for name in args.layouts:
            dist.barrier()
            t = time.perf_counter()
            step(name)
            res["layouts"][name]["times"].append(_max(time.perf_counter() - t))
    for r in res["layouts"].values():
        r["step_s"] = sorted(r["times"])[len(r["times"]) // 2]
    return res


def markdown(res: dict) -> str:
    a = res["args"]
    rows = res["layouts"]
    base = next(iter(rows.values()))
    lines = [
        f"4 processes (gloo, CPU), Llama dim={a['dim']} layers={a['n_layers']} heads={a['n_heads']} kv_heads={a['n_kv_heads']}, "
        f"{a['seq_len']:,} tokens, fp32, AutoSP + SAC (aot_eager); per rank and training step, the largest of the four ranks. "
        f"{res['machine']}",
        "",
        "| layout | all-to-all MiB sent | ring MiB sent | total MiB sent | vs first | step s | vs first | peak MiB | saved MiB | loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    total0 = base["exchange_bytes"] + base["ring_bytes"]
    for name, r in rows.items():
        total = r["exchange_bytes"] + r["ring_bytes"]
        lines.append(
            f"| {name} | {r['exchange_bytes'] / MiB:.1f} | {r['ring_bytes'] / MiB:.1f} | {total / MiB:.1f} | {total / total0:.2f}x | "
            f"{r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f}x | {r['peak'] / MiB:.0f} | {r['saved'] / MiB:.0f} | {r['loss']:.6f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    res = run_distributed(run, 4, args)
    res.update(args=arguments(args), machine=machine())
    return finish(res, args, markdown)


if __name__ == "__main__":
    main()
