"""Tiled MLPs and activation offload at length, side by side in one run: sp=2 on CPU/gloo.

A Hugging Face Llama built from a small config whose MLP is ``--ffn / --dim`` times wider than
its hidden size (Llama-3-8B: 3.5), called as training code calls it (``use_cache=False``), one row
of S tokens per SP group, AutoSP with SAC (aot_eager, fp32):

* ``base``: MLPs run whole (``tiled_mlp=False``), nothing offloaded;
* ``tiled``: MLPs over tiles of ``--mlp-tile`` rows (``tiled_mlp=<rows>``);
* ``offload``: every saved activation to host memory (``activation_offload=True``);
* ``tiled+offload``: both.

Per rank (rank 0; times: the slower rank): bytes saved for backward on the device and in host
memory (the compiled graph's record), the peak resident memory of one forward+backward above the
level before it (``/proc/self/clear_refs``), the step time (median over ``--steps``), and the
largest relative difference of the gradients from ``base``. On CPU the host is the device: an
offloaded tensor still takes resident memory (twice, for a moment, while it is copied), so the
peak of the offload cases says nothing about a GPU's; the device bytes saved are what offload
moves off it. The tiled MLP's gain is the peak: with SAC its intermediates are not saved anyway,
but without tiles backward holds them, and their gradients, for every row at once.

The figures in BENCHMARKS.md (part of ``make benchmarks``; about 10 minutes on 2 cores)::

    .venv/bin/python benchmarks/long_rows.py --seq-len 32768 --out benchmarks/results/long_rows.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.distributed as dist
from _common import MiB, PeakRSS, arguments, finish, machine, parser, ratio, run_distributed

from autosp.backend import AutoSPBackend
from autosp.passes.offload import OffloadConfig
from autosp.passes.sac import SACConfig

CASES = ("base", "tiled", "offload", "tiled+offload")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(__doc__, threads=True)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ffn", type=int, default=448, help="MLP width (3.5 x dim, as Llama-3-8B)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--mlp-tile", type=int, default=1024, help="rows per MLP tile in the tiled cases")
    p.add_argument("--steps", type=int, default=2, help="timed steps per case (>= 1)")
    p.add_argument("--sp-size", type=int, default=2)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq_len,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    group = dist.group.WORLD.group_name
    S = args.seq_len
    ids = torch.randint(0, args.vocab, (1, S), generator=torch.Generator().manual_seed(S))
    per: dict = {}
    grads: dict = {}
    for case in args.cases:
        model = build(args)
        backend = AutoSPBackend(
            sp_size=args.sp_size, sp_rank=rank, group_name=group, backend="aot_eager", sac=SACConfig(),
            mlp_tile=args.mlp_tile if "tiled" in case else None, offload=OffloadConfig(True) if "offload" in case else None,
        )

        def step(ids, model=model):
            return model(input_ids=ids, labels=ids, use_cache=False).loss

        compiled = torch.compile(step, backend=backend)
        x = ids.clone()
        torch._dynamo.mark_dynamic(x, 1)
        t0 = time.perf_counter()
        compiled(x).backward()  # compile
        compile_s = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        times, peak = [], PeakRSS()
        for rep in range(args.steps):
            dist.barrier()
            if rep == 0:
                peak.start()
            t0 = time.perf_counter()
            loss = compiled(x)
            loss.backward()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            if rep == 0:
                peak_bytes = peak.stop()
                grads[case] = {n: p.grad.clone() for n, p in model.named_parameters()}
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
            times.append(float(dt))
            model.zero_grad(set_to_none=True)
        record = backend.saved_activations[-1]
        base = grads.get("base")
        diff = (max(float((grads[case][n] - base[n]).norm() / base[n].norm().clamp_min(1e-30)) for n in base)
                if base is not None else None)
        per[case] = {
            "saved_device": sum(record.bytes_by_kind().values()), "saved_host": record.host_bytes(), "peak": peak_bytes,
            "step_s": statistics.median(times), "compile_s": compile_s, "loss": float(loss.detach()),
            "tiled_regions": backend.pass_stats[-1].tiled_regions, "grad_rel_diff": diff,
        }
        if rank == 0:
            print(f"S={S} {case}: step {per[case]['step_s']:.1f}s, device {per[case]['saved_device'] / MiB:.1f} MiB, "
                  f"host {per[case]['saved_host'] / MiB:.1f} MiB, peak {peak_bytes / MiB:.0f} MiB", flush=True)
        del model, compiled, backend
        torch._dynamo.reset()
    return {"config": arguments(args), "machine": machine(), "cases": per}


def report(res: dict) -> str:
    c = res["config"]
    lines = [
        f"Hugging Face Llama (sdpa) dim={c['dim']} ffn={c['ffn']} layers={c['layers']} heads={c['heads']} "
        f"kv_heads={c['kv_heads']} vocab={c['vocab']}, one row of {c['seq_len']} tokens, sp={c['sp_size']}, aot_eager + SAC, "
        f"fp32, MLP tiles of {c['mlp_tile']} rows, {c['threads']} thread(s) per rank. Per rank (rank 0); {res['machine']}.",
        "",
        "| case | MLPs tiled | saved on the device MiB | saved in host memory MiB | peak MiB | step s | vs base: device saved / peak / time | gradients vs base |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cases = res["cases"]
    base = cases.get("base")
    for case, x in cases.items():
        vs = (f"{ratio(x['saved_device'], base['saved_device'])} / {ratio(x['peak'], base['peak'])} / {ratio(x['step_s'], base['step_s'])}"
              if base else "-")
        diff = f"{x['grad_rel_diff']:.1e}" if x["grad_rel_diff"] is not None else "-"
        lines.append(
            f"| {case} | {x['tiled_regions']} | {x['saved_device'] / MiB:.1f} | {x['saved_host'] / MiB:.1f} | {x['peak'] / MiB:.0f} | "
            f"{x['step_s']:.1f} | {vs} | {diff} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    res = run_distributed(run, args.sp_size, args, threads=args.threads)
    return finish(res, args, report)


if __name__ == "__main__":
    main()
