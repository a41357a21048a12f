"""Masks at length: packed documents and sliding windows with the dense ``S x S`` mask against the
tiled mask, and plain causal attention as the floor - side by side in one run, sp=2 on CPU/gloo.

Hugging Face models built from small configs (Llama for packed documents, Mistral for its sliding
window; ``attn_implementation="sdpa"``), called as training code calls them (``use_cache=False``, so
the model builds its mask), one row per SP group:

* ``plain``: the same Llama with plain causal attention (``is_causal=True``, no mask): the floor;
* ``causal mask``: the same Llama with its own attention, one document per row and no padding:
  plain causal rows through the mask Hugging Face builds (what training code runs), which AutoSP
  finds exactly causal at run time and runs as the fused kernel's ``is_causal``, no tiles;
* ``documents dense`` / ``documents tiled``: documents of ``--doc-len`` tokens packed in the row
  (``position_ids`` restart at each), ``AutoSPStrategy(tiled_attention=False)`` / ``True``;
* ``window dense`` / ``window tiled``: Mistral with a ``--window``-token sliding window.

Per rank (rank 0; times: the slower rank): bytes saved for backward (the compiled graph's record,
and what autograd really keeps, ``saved_tensors_hooks``), the peak resident memory of one
forward+backward above the level before it (``/proc/self/clear_refs``, glibc returning large
frees at once), the step time (median over ``--steps`` rounds, each timing every case once, so
that a busy moment of the machine falls on all of them), and the share of attention tiles the
tiled kernel computed. The tiled and dense gradients are compared (largest relative difference).

The figures in BENCHMARKS.md, section 8 (part of ``make benchmarks``; about 20 minutes on 2 cores)::

    .venv/bin/python benchmarks/masks.py --seq-lens 16384 32768 --out benchmarks/results/masks.json
    .venv/bin/python benchmarks/masks.py --seq-lens 16384 --cases plain "causal mask" --steps 3 --out benchmarks/results/masks_causal.json
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
from _common import MiB, PeakRSS, SavedBytes, arguments, finish, machine, parser, ratio, run_distributed

from autosp.ops import tiled_attention as kernel
from autosp.backend import AutoSPBackend
from autosp.passes.sac import SACConfig

CASES = ("plain", "causal mask", "documents dense", "documents tiled", "window dense", "window tiled")
PLAIN = "benchmark_plain_causal"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(__doc__, threads=True)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--doc-len", type=int, default=1024, help="tokens per packed document")
    p.add_argument("--window", type=int, default=4096, help="Mistral's sliding window")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=2, help="timed steps per case and length (>= 1)")
    p.add_argument("--sp-size", type=int, default=2)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def _plain_causal(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention without a mask (``is_causal=True``): the floor the masked cases are measured against."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def build(case: str, args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    transformers.AttentionInterface.register(PLAIN, _plain_causal)
    common = dict(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq_lens),
        attn_implementation=PLAIN if case == "plain" else "sdpa",
    )
    torch.manual_seed(0)
    if case.startswith("window"):
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=args.window))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    group = dist.group.WORLD.group_name
    results: dict = {"config": arguments(args), "machine": machine(), "lengths": {}}
    for S in args.seq_lens:
        g = torch.Generator().manual_seed(S)
        ids = torch.randint(0, args.vocab, (1, S), generator=g)
        docs = (torch.arange(S) % args.doc_len)[None]
        per: dict = {}
        grads: dict = {}
        built: dict = {}
        for case in args.cases:  # compile each case, then measure its memory in a step of its own
            model = build(case, args)
            backend = AutoSPBackend(
                sp_size=args.sp_size, sp_rank=rank, group_name=group, backend="aot_eager", sac=SACConfig(),
                attention_tile=None if case.endswith("dense") else 0,
            )
            positions = docs if case.startswith("documents") else torch.arange(S)[None]

            def step(ids, positions, model=model):
                return model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss

            compiled = torch.compile(step, backend=backend)
            x, pos = ids.clone(), positions.clone()
            for t in (x, pos):
                torch._dynamo.mark_dynamic(t, 1)
            t0 = time.perf_counter()
            compiled(x, pos).backward()  # compile
            compile_s = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            saved, peak = SavedBytes([*model.parameters(), *model.buffers(), x, pos]), PeakRSS()
            before = dict(kernel.TILE_COUNTS)
            dist.barrier()
            peak.start()
            with saved.hooks():
                loss = compiled(x, pos)
            loss.backward()
            peak_bytes = peak.stop()
            tiles = {k: kernel.TILE_COUNTS[k] - before[k] for k in before}
            grads[case] = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            record = backend.saved_activations[-1]
            stats = backend.pass_stats[-1]
            computed = tiles["computed"] + tiles["skipped"]
            per[case] = {
                "saved": sum(record.bytes_by_kind().values()), "kept_by_autograd": saved.total, "peak": peak_bytes,
                "compile_s": compile_s, "loss": float(loss.detach()), "tiled": stats.tiled_attention, "dense_masks": len(stats.dense_masks),
                "tiles_computed": tiles["computed"] / computed if computed else None, "causal_calls": tiles.get("causal", 0),
                "times": [],
            }
            built[case] = (model, compiled, x, pos)
        for _ in range(args.steps):  # timed steps interleaved: each round runs every case once
            for case, (model, compiled, x, pos) in built.items():
                dist.barrier()
                t0 = time.perf_counter()
                compiled(x, pos).backward()
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
                per[case]["times"].append(float(dt))
                model.zero_grad(set_to_none=True)
        for case, x in per.items():
            x["step_s"] = statistics.median(x.pop("times"))
            if rank == 0:
                print(f"S={S} {case}: step {x['step_s']:.1f}s, saved {x['saved'] / MiB:.1f} MiB, peak {x['peak'] / MiB:.0f} MiB", flush=True)
        del built
        torch._dynamo.reset()
        diffs = {}
        for kind in ("documents", "window"):
            a, b = grads.get(f"{kind} tiled"), grads.get(f"{kind} dense")
            if a is not None and b is not None:
                diffs[kind] = max(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)) for n in a)
        results["lengths"][S] = {"cases": per, "grad_rel_diff": diffs}
    return results


def report(res: dict) -> str:
    c = res["config"]
    lines = [
        f"Hugging Face Llama / Mistral (sdpa) dim={c['dim']} layers={c['layers']} heads={c['heads']} kv_heads={c['kv_heads']} "
        f"ffn={c['ffn']} vocab={c['vocab']}, one row of S tokens per SP group, sp={c['sp_size']}, aot_eager + SAC, fp32, "
        f"{c['threads']} thread(s) per rank; documents of {c['doc_len']} tokens, a {c['window']}-token window. Per rank "
        f"(rank 0); {res['machine']}.",
        "",
        "| S | case | saved for backward MiB | kept by autograd MiB | peak MiB | step s | tiles computed | vs plain: saved / peak / time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for S, r in res["lengths"].items():
        cases = r["cases"]
        floor = cases.get("plain")
        for case, x in cases.items():
            tiles = f"{100 * x['tiles_computed']:.1f}%" if x["tiles_computed"] is not None else "-"
            if x.get("causal_calls"):
                tiles = f"none: is_causal x{x['causal_calls']}"
            vs = (f"{ratio(x['saved'], floor['saved'])} / {ratio(x['peak'], floor['peak'])} / {ratio(x['step_s'], floor['step_s'])}"
                  if floor else "-")
            lines.append(
                f"| {S} | {case} | {x['saved'] / MiB:.1f} | {x['kept_by_autograd'] / MiB:.1f} | {x['peak'] / MiB:.0f} | "
                f"{x['step_s']:.1f} | {tiles} | {vs} |"
            )
    lines += ["", "| S | mask | tiled / dense: saved | peak | step time | gradients, largest relative difference |", "|---|---|---|---|---|---|"]
    for S, r in res["lengths"].items():
        cases = r["cases"]
        for kind in ("documents", "window"):
            t, d = cases.get(f"{kind} tiled"), cases.get(f"{kind} dense")
            if t and d:
                lines.append(
                    f"| {S} | {kind} | {ratio(t['saved'], d['saved'])} | {ratio(t['peak'], d['peak'])} | "
                    f"{ratio(t['step_s'], d['step_s'])} | {r['grad_rel_diff'].get(kind, float('nan')):.1e} |"
                )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    res = run_distributed(run, args.sp_size, args, threads=args.threads)
    return finish(res, args, report)


if __name__ == "__main__":
    main()
