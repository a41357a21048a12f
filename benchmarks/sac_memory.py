"""Activation memory and step time of AutoSP with and without sequence-aware activation
checkpointing (SAC), on the bundled Llama, sp=2 on CPU/gloo (two forked processes).

For every sequence length it reports, per SP rank:

* bytes saved for backward per op kind (``autosp.passes.accounting.OP_KINDS``), read from the
  compiled training graph and cross-checked against what autograd really keeps
  (``saved_tensors_hooks`` during one forward);
* the same bytes grouped by block: the attention block (everything inside the model's
  ``Attention`` modules, the SP all-to-alls and attention itself) and the MLP block
  (everything inside ``FeedForward``); norms, embedding, residuals and the loss are "rest";
* the forward+backward time of one step (median over ``--steps``, SAC and no-SAC steps
  interleaved, the slower rank counts; the first step of each also records what autograd
  keeps) and the largest relative gradient difference between the two.

The figures in ``docs/memory.md`` (about 2 minutes on 2 cores; not run by ``make benchmarks``)::

    .venv/bin/python benchmarks/sac_memory.py --seq-lens 1024 4096 16384 --steps 3 --plot sac_memory.png
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    MiB, SavedBytes, arguments, check_steps_and_seq_lens, finish, llama_config, parser, ratio, run_distributed,
)

from autosp.backend import AutoSPBackend
from autosp.passes.accounting import OP_KINDS, SavedTensor
from autosp.models import Llama
from autosp.passes.sac import SACConfig


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(
        __doc__, plot="bar chart of the longest length, per op kind", threads=True,
        model=dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=768, vocab_size=512),
    )
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--sp-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration and length (>= 1)")
    args = p.parse_args(argv)
    check_steps_and_seq_lens(p, args, "steps")
    return args


def block_of(t: SavedTensor) -> str:
    if any("Attention" in m for m in t.modules) or t.kind in ("attention", "all_to_all") and not t.modules:
        return "attention_block"
    if any("FeedForward" in m or "MLP" in m for m in t.modules):
        return "mlp_block"
    return "rest"



def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    cfg = llama_config(args, max_seq_len=max(args.seq_lens))
    group = dist.group.WORLD.group_name
    configs = {"no_sac": None, "sac": SACConfig()}
    models, steps, backends = {}, {}, {}
    for name, sac in configs.items():
        torch.manual_seed(0)
        model = Llama(cfg)
        backend = AutoSPBackend(sp_size=args.sp_size, sp_rank=rank, group_name=group, backend="aot_eager", sac=sac)

        def step(ids, labels, model=model):
            logits = model(ids)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))

        models[name], backends[name] = model, backend
        steps[name] = torch.compile(step, backend=backend)

    def batch(S: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab_size, (args.batch_size, S), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (args.batch_size, S), generator=g)
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(labels, 1)
        return ids, labels

    def fwd_bwd(name: str, ids, labels, saved: Optional[SavedBytes] = None) -> float:
        """One timed forward+backward; ``saved`` records what autograd keeps."""
        dist.barrier()
        t = time.perf_counter()
        if saved is None:
            steps[name](ids, labels).backward()
        else:
            with saved.hooks():
                loss = steps[name](ids, labels)
            loss.backward()
        dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
        return float(dt)

    compile_s = {}
    ids, labels = batch(min(args.seq_lens), 0)
    for name in configs:  # compile (one graph serves every length)
        t = time.perf_counter()
        fwd_bwd(name, ids, labels)
        compile_s[name] = time.perf_counter() - t
        models[name].zero_grad(set_to_none=True)

    results = {"config": arguments(args) | {"model": cfg.__dict__}, "compile_s": compile_s, "lengths": {}}
    for S in args.seq_lens:
        ids, labels = batch(S, S)
        per = {name: {"times": []} for name in configs}
        grads = {}
        for rep in range(args.steps):  # SAC and no-SAC steps interleaved
            for name in configs:
                model = models[name]
                if rep == 0:  # also record what autograd keeps: the cross-check of the record
                    saved = SavedBytes([*model.parameters(), *model.buffers(), ids, labels])
                    per[name]["times"].append(fwd_bwd(name, ids, labels, saved))
                    rec = backends[name].saved_activations[-1]
                    per[name].update(
                        by_kind=rec.bytes_by_kind(), by_block=rec.bytes_by(block_of),
                        kept_by_autograd=saved.total, recomputed=rec.recomputed,
                    )
                    grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
                else:
                    per[name]["times"].append(fwd_bwd(name, ids, labels))
                model.zero_grad(set_to_none=True)
        g0, g1 = grads["no_sac"], grads["sac"]
        grad_diff = max(float((g1[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-30)) for n in g0)
        for name in configs:
            per[name]["step_s"] = statistics.median(per[name]["times"])
        results["lengths"][S] = {"rank": rank, "grad_rel_diff": grad_diff, **per}
        if rank == 0:
            print(f"S={S}: no_sac {per['no_sac']['step_s']:.2f}s, sac {per['sac']['step_s']:.2f}s", flush=True)
    return results


def report(res: dict) -> str:
    lines = []
    cfg = res["config"]
    lines.append(
        f"Llama dim={cfg['dim']} layers={cfg['n_layers']} heads={cfg['n_heads']} kv_heads={cfg['n_kv_heads']} "
        f"ffn={cfg['ffn_hidden']} vocab={cfg['vocab_size']}, batch {cfg['batch_size']}, sp={cfg['sp_size']}, "
        f"aot_eager, fp32, {cfg['threads']} thread(s) per rank; per-rank figures of rank 0."
    )
    lines.append("")
    kinds = " | ".join(OP_KINDS)
    lines.append(f"| S | SAC | {kinds} | total MiB | kept by autograd MiB | step s |")
    lines.append("|" + "---|" * (len(OP_KINDS) + 5))
    for S, r in res["lengths"].items():
        for name in ("no_sac", "sac"):
            x = r[name]
            cells = " | ".join(f"{x['by_kind'][k] / MiB:.2f}" for k in OP_KINDS)
            total = sum(x["by_kind"].values())
            lines.append(
                f"| {S} | {'on' if name == 'sac' else 'off'} | {cells} | {total / MiB:.2f} | "
                f"{x['kept_by_autograd'] / MiB:.2f} | {x['step_s']:.2f} |"
            )
    lines.append("")
    lines.append("| S | attention block off -> on (MiB) | ratio | MLP block off -> on (MiB) | ratio | "
                 "linear kind ratio | total ratio | SAC step time overhead | max grad rel diff |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for S, r in res["lengths"].items():
        off, on = r["no_sac"], r["sac"]
        ab = (off["by_block"].get("attention_block", 0), on["by_block"].get("attention_block", 0))
        mb = (off["by_block"].get("mlp_block", 0), on["by_block"].get("mlp_block", 0))
        tot = (sum(off["by_kind"].values()), sum(on["by_kind"].values()))
        lines.append(
            f"| {S} | {ab[0] / MiB:.2f} -> {ab[1] / MiB:.2f} | {ratio(*ab)} | {mb[0] / MiB:.2f} -> {mb[1] / MiB:.2f} | "
            f"{ratio(*mb)} | {ratio(off['by_kind']['linear'], on['by_kind']['linear'])} | {ratio(*tot)} | "
            f"{100 * (on['step_s'] / off['step_s'] - 1):+.1f}% | {r['grad_rel_diff']:.1e} |"
        )
    lines.append("")
    lines.append(f"compile: {', '.join(f'{k} {v:.1f}s' for k, v in res['compile_s'].items())}")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    from lightning_autosp.monitor import plot_saved_bytes

    S = max(res["lengths"])
    r = res["lengths"][S]
    cfg = res["config"]
    plot_saved_bytes(
        {"no SAC": r["no_sac"]["by_kind"], "SAC": r["sac"]["by_kind"]}, path,
        title=f"Saved for backward per rank, Llama d={cfg['dim']}, S={S}, sp={cfg['sp_size']}",
    )


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    res = run_distributed(run, args.sp_size, args, threads=args.threads)
    return finish(res, args, report, plot)


if __name__ == "__main__":
    main()
