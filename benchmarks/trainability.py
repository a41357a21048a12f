"""The longest trainable sequence on 8 x 80 GB GPUs, predicted from traced graphs.

For Llama-3.2-1B and Llama-3.1-8B shapes (configurations only; no weights are loaded and
nothing is run) the training step is traced through the same passes AutoSP applies, for rank
0 of an 8-way SP group (``autosp/memory/model.py``), and per-rank memory is

    static (parameters, gradients, optimizer states; per data-parallel setting)
  + the activation peak of the step (saved activations + transients, from a liveness walk)

The longest sequence is the largest multiple of ``--granule`` whose total stays within
``--gpu-gib`` x ``--usable``; also reported is the largest power of two (what a doubling
search finds). Assumptions (printed with the results):

* bf16 weights and activations in the traced step; mixed-precision Adam: 16 bytes per
  parameter (bf16 weight and gradient, fp32 master weight and two moments);
* ``zero3``: parameters, gradients and optimizer states sharded over all 8 ranks (the
  paper's baseline, ZeRO-3/FSDP), plus, for the largest module, two gathered bf16 copies
  of its parameters (the one computing and the one prefetched) and its unsharded bf16
  gradients before their reduce-scatter; ``autosp_fsdp``: ``AutoSPStrategy(fsdp=True)``, the
  same 16 bytes per parameter sharded over all 8 ranks but held as fp32 parameter and gradient
  shards and two fp32 moments (``bf16-mixed`` keeps fp32 parameters), plus, for the largest
  module, its parameters gathered in bf16 (``bf16-mixed`` gathers in bfloat16, one bucket per
  block) and its unsharded fp32 gradients before their reduce-scatter (6 bytes per parameter;
  a block's bucket is gathered where the block starts and again in backward, no prefetch
  assumed; not yet measured on a GPU); ``ddp``: every
  rank holds everything (``AutoSPStrategy(fsdp=False)``, the default);
* batch 1 sequence per SP group (SP variants) or per rank (no SP); causal attention with a
  fused kernel that keeps only its output and log-sum-exp (the CPU flash kernel is traced;
  CUDA flash attention keeps the same); token-mean cross-entropy on un-upcast bf16 logits;
* the liveness walk is over unfused graphs: an upper bound for inductor, which never
  materialises many of those transients; allocator fragmentation, the CUDA context and
  NCCL buffers are covered by ``--usable`` (default 0.9 of the GPU);
* 2- and 3-layer traces extrapolated linearly to the full depth (checked against a 4-layer
  trace, printed).

Example (the figures in BENCHMARKS.md)::

    .venv/bin/python benchmarks/trainability.py --out benchmarks/results/trainability.json \\
        --plot benchmarks/results/trainability.png
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Optional

from autosp.memory import model as mm
from _common import GiB, arguments, finish, machine, parser, plot_panels

from autosp.models import LlamaConfig
from autosp.memory.plan import limit_of, longest, static_bytes
from autosp.passes.offload import parse_bytes

SETTINGS = ("zero3", "autosp_fsdp", "ddp")
# the sharded mode is AutoSP's own: only its variants run under it
SETTING_VARIANTS = {
    "autosp_fsdp": (
        "sp", "sp_sac", "sp_sac_logits", "sp_sac_tiled", "sp_sac_offload", "sp_sac_tiled_offload", "sp_block", "sp_block_offload",
        "sp_block_tiled", "sp_block_tiled_offload",
    ),
}
#: DeepSpeed ALST (2025), Llama-3.1-8B on one node of 8 x H100 80 GB: measured, tokens per sequence
ALST_8B_NODE = 3_700_000
#: the same on four nodes (32 GPUs, Ulysses across the nodes)
ALST_8B_4_NODES = 15_000_000
#: the variant of the rows across nodes: ALST's recipe (whole blocks, tiled regions, offload)
NODES_VARIANT = "sp_block_tiled_offload"
#: the options added in turn in the comparison with ALST (autosp_fsdp)
ALST_STEPS = (
    "sp_sac", "sp_sac_tiled", "sp_sac_offload", "sp_sac_tiled_offload", "sp_block", "sp_block_offload", "sp_block_tiled_offload",
)
LABELS = {
    "no_sp_eager": "no SP, eager autograd",
    "no_sp": "no SP, compiled",
    "no_sp_ac": "no SP, compiled, full activation checkpointing",
    "ulysses_eager": "Ulysses SP, eager autograd (hand-written)",
    "sp": "AutoSP, no SAC",
    "sp_sac": "AutoSP + SAC",
    "sp_sac_logits": "AutoSP + SAC, full logits (chunked_loss=False)",
    "sp_sac_tiled": "AutoSP + SAC + tiled MLP",
    "sp_sac_offload": "AutoSP + SAC + activation offload",
    "sp_sac_tiled_offload": "AutoSP + SAC + tiled MLP + activation offload",
    "sp_block": "AutoSP, blocks recomputed whole (sac='block')",
    "sp_block_offload": "AutoSP, blocks recomputed whole + activation offload",
    "sp_block_tiled": "AutoSP, blocks recomputed whole + tiled MLP",
    "sp_block_tiled_offload": "AutoSP, blocks recomputed whole + tiled MLP + activation offload",
}
PAPER = {"autosp_vs_handwritten": 2.7, "sac_vs_sp": 1.66, "vs_zero3_8b": 5.6}
#: AutoSP + SAC under other masks than plain causal: (mask, tiled) -> label
MASK_ROWS = {
    ("causal", True): "plain causal (is_causal=True)",
    ("documents", False): f"packed documents of {mm.DOCUMENT_TOKENS:,} tokens, dense mask (tiled_attention=False)",
    ("documents", True): f"packed documents of {mm.DOCUMENT_TOKENS:,} tokens, tiled mask",
    ("window", False): f"{mm.WINDOW_TOKENS:,}-token sliding window, dense mask (tiled_attention=False)",
    ("window", True): f"{mm.WINDOW_TOKENS:,}-token sliding window, tiled mask",
}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(__doc__, plot="per-rank memory against sequence length")
    p.add_argument("--models", nargs="+", choices=list(mm.PRESETS), default=list(mm.PRESETS))
    p.add_argument("--sp-size", type=int, default=8, help="SP group size = GPUs (one node)")
    p.add_argument("--gpu-memory", default="80GiB", help="memory per GPU as plan reads it: GB = 10^9 bytes, GiB = 2^30 "
                   "(default 80GiB: an '80 GB' A100/H100)")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4],
                   help="Llama-3.1-8B with one SP group over this many nodes (Ulysses over a node, a ring across)")
    p.add_argument("--usable", type=float, default=0.9, help="fraction of it a step may use")
    p.add_argument("--granule", type=int, default=1024, help="sequence lengths searched are multiples of this")
    p.add_argument("--host-gib", type=float, default=2048.0, help="host memory per node, GiB (offloaded activations)")
    p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    args = p.parse_args(argv)
    try:
        args.gpu_memory = parse_bytes(args.gpu_memory, "--gpu-memory")
    except ValueError as exc:
        p.error(str(exc))
    if args.granule % args.sp_size:
        p.error(f"--granule ({args.granule}) must be a multiple of --sp-size ({args.sp_size})")
    if not 0 < args.usable <= 1:
        p.error("--usable must be in (0, 1]")
    return args


def pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def run(args: argparse.Namespace) -> dict:
    budget = args.gpu_memory * args.usable
    host_budget = args.host_gib * GiB * args.usable / args.sp_size
    out: dict = {"args": arguments(args), "machine": machine(), "models": {}, "paper": PAPER}
    for name in args.models:
        preset = mm.PRESETS[name]
        cfg = LlamaConfig(**preset["config"], max_seq_len=1 << 24)
        params = mm.param_counts(cfg, preset["tied"])
        t = time.perf_counter()
        models = mm.layer_models(cfg, mm.VARIANTS, args.sp_size)  # offload variants read their base's traces
        masked = {key: models["sp_sac"] if key == ("causal", True) else mm.layer_model(cfg, "sp_sac", args.sp_size, mask=key[0], tiled=key[1])
                  for key in MASK_ROWS}
        # linear extrapolation in depth, checked against a real 4-layer trace
        check = mm.trace(replace(cfg, n_layers=4), "sp_sac", args.sp_size).memory(65536)
        pred = models["sp_sac"].memory(65536, n_layers=4)
        extrapolation_err = max(abs(pred[k] - check[k]) / check[k] for k in check if check[k])
        per_token = {v: m.memory(65536)["saved"] / 65536 for v, m in models.items()}
        rows: dict = {}
        for setting in args.settings:
            parts = static_bytes(params, setting, args.sp_size)
            static = parts["total"]
            rows[setting] = {"static_bytes": static, "static": parts, "variants": {}}
            for v, m in models.items():
                if v not in SETTING_VARIANTS.get(setting, models):
                    continue
                S = longest(m.memory, static, budget, args.granule, host_budget=host_budget)
                rows[setting]["variants"][v] = {
                    "longest": S, "pow2": pow2_floor(S), "memory_at_longest": m.memory(S) if S else None,
                    "limit": limit_of(m.memory, static, host_budget, S, args.granule),
                }
        masks = {}
        for setting in args.settings:
            if setting == "zero3":
                continue
            static = rows[setting]["static_bytes"]
            masks[setting] = {
                f"{mask}-{'tiled' if tiled else 'dense'}": {"label": MASK_ROWS[(mask, tiled)], "longest": (S := longest(m.memory, static, budget, args.granule)),
                                                            "memory_at_longest": m.memory(S) if S else None}
                for (mask, tiled), m in masked.items()
            }
        nodes = {}
        if name == "llama-3.1-8b":  # one SP group over several nodes: Ulysses over a node's GPUs, a ring across
            for n in (n for n in args.nodes if n > 1):
                sp = args.sp_size * n
                m = mm.layer_model(cfg, NODES_VARIANT, sp, sp_layout=(args.sp_size, n))
                static = static_bytes(params, "autosp_fsdp", sp)["total"]
                S = longest(m.memory, static, budget, args.granule * n, host_budget=host_budget)
                nodes[n] = {
                    "sp_size": sp, "layout": [args.sp_size, n], "static_bytes": static, "longest": S,
                    "memory_at_longest": m.memory(S) if S else None, "limit": limit_of(m.memory, static, host_budget, S, args.granule * n),
                }
        out["models"][name] = {
            "params": params, "trace_s": time.perf_counter() - t, "extrapolation_rel_err": extrapolation_err,
            "saved_bytes_per_token": per_token, "settings": rows, "masks": masks, "nodes": nodes,
            "curves": {v: {S: m.memory(S)["peak"] for S in (1 << k for k in range(13, 22))} for v, m in models.items()},
        }
        print(f"{name}: traced in {time.perf_counter() - t:.0f}s; depth extrapolation error {extrapolation_err:.1e}", flush=True)
    return out


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}x" if b else ("inf" if a else "-")


def markdown(res: dict) -> str:
    a = res["args"]
    budget = _gpu_gib(a) * a["usable"]
    lines = [
        f"{a['sp_size']} GPUs x {_gpu_gib(a):.0f} GiB, a step may use {a['usable']:.0%} ({budget:.0f} GiB); SP variants: "
        f"sp={a['sp_size']} (one sequence over the node); no-SP variants: one sequence per GPU. Lengths are multiples "
        f"of {a['granule']}.",
        "",
    ]
    for name, m in res["models"].items():
        p = m["params"]
        lines += [
            f"**{name}** ({p['total'] / 1e9:.2f} B parameters; saved activations per token per rank, at 64k tokens: "
            + ", ".join(f"{LABELS[v]} {b / 1024:.0f} KiB" for v, b in m["saved_bytes_per_token"].items())
            + f"; depth extrapolation checked against a 4-layer trace: {m['extrapolation_rel_err']:.1e} rel. error)",
            "",
            "| data-parallel setting | static GiB/rank | variant | longest sequence | largest power of 2 | "
            "activation peak at that length GiB | vs no SP (eager) | vs hand-written Ulysses | vs AutoSP no SAC |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for setting, row in m["settings"].items():
            vs = row["variants"]
            base = m["settings"].get("zero3", row)["variants"] if setting in SETTING_VARIANTS else vs  # baselines
            for v, r in vs.items():
                mem = r["memory_at_longest"]
                lines.append(
                    f"| {setting} | {row['static_bytes'] / GiB:.1f} | {LABELS[v]} | {r['longest']:,} | {r['pow2']:,} | "
                    f"{mem['peak'] / GiB if mem else 0:.1f} | {_ratio(r['longest'], base['no_sp_eager']['longest'])} | "
                    f"{_ratio(r['longest'], base['ulysses_eager']['longest'])} | {_ratio(r['longest'], vs['sp']['longest'])} |"
                )
        lines.append("")
        for setting, row in m["settings"].items():
            if "static" in row:
                parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in row["static"].items() if k != "total")
                lines.append(f"- static GiB per rank, {setting}: {parts}")
        lines.append("")
    lines += comparison(res)
    lines += mask_table(res)
    lines += alst_table(res)
    return "\n".join(lines)


def alst_table(res: dict) -> list[str]:
    """Llama-3.1-8B on one node, AutoSP's options added in turn, next to DeepSpeed ALST's measured length."""
    a = res["args"]
    m = res["models"].get("llama-3.1-8b")
    row = m and m["settings"].get("autosp_fsdp")
    if not row:
        return []
    lines = [
        "",
        f"| Llama-3.1-8B, {a['sp_size']} x {_gpu_gib(a):.0f} GiB, fsdp=True | longest sequence (predicted) | vs ALST "
        f"{ALST_8B_NODE / 1e6:.1f}M (measured) | device GiB/rank: static + saved + transients | host GiB per node | what limits it |",
        "|---|---|---|---|---|---|",
    ]
    for v in ALST_STEPS:
        r = row["variants"].get(v)
        if r is None:
            continue
        mem = r["memory_at_longest"] or {"saved": 0, "peak": 0, "host": 0}
        device = f"{row['static_bytes'] / GiB:.1f} + {mem['saved'] / GiB:.1f} + {(mem['peak'] - mem['saved']) / GiB:.1f}"
        lines.append(
            f"| {LABELS[v]} | {r['longest']:,} | {r['longest'] / ALST_8B_NODE:.2f}x | {device} | "
            f"{mem.get('host', 0) * a['sp_size'] / GiB:.0f} | {r['limit']} |"
        )
    if m.get("nodes"):
        lines += [
            "",
            f"| Llama-3.1-8B, one SP group over nodes of {a['sp_size']} x {_gpu_gib(a):.0f} GiB, fsdp=True, {LABELS[NODES_VARIANT]} | "
            f"longest sequence (predicted) | vs ALST (measured: {ALST_8B_NODE / 1e6:.1f}M on 1 node, {ALST_8B_4_NODES / 1e6:.0f}M on 4) | "
            "device GiB/rank: static + saved + transients | host GiB per node | what limits it |",
            "|---|---|---|---|---|---|",
        ]
        one = row["variants"].get(NODES_VARIANT)
        entries = [(1, {"sp_size": a["sp_size"], "layout": [a["sp_size"], 1], "static_bytes": row["static_bytes"], **one})] if one else []
        for n, r in sorted(((int(k), v) for k, v in m["nodes"].items())):
            entries.append((n, r))
        for n, r in entries:
            mem = r["memory_at_longest"] or {"saved": 0, "peak": 0, "host": 0}
            alst = {1: ALST_8B_NODE, 4: ALST_8B_4_NODES}.get(n)
            device = f"{r['static_bytes'] / GiB:.1f} + {mem['saved'] / GiB:.1f} + {(mem['peak'] - mem['saved']) / GiB:.1f}"
            lines.append(
                f"| {n} node(s), sp_size={r['sp_size']} as ulysses={r['layout'][0]} x ring={r['layout'][1]} | {r['longest']:,} | "
                f"{_ratio(r['longest'], alst) if alst else '-'} | "
                f"{device} | {mem.get('host', 0) * a['sp_size'] / GiB:.0f} | {r['limit']} |"
            )
    return lines


def _gpu_gib(a: dict) -> float:
    """GPU memory of a results file's arguments in GiB (older files: ``gpu_gib``)."""
    return a["gpu_memory"] / GiB if "gpu_memory" in a else a["gpu_gib"]


def mask_table(res: dict) -> list[str]:
    """AutoSP + SAC's longest sequence with packed documents and sliding windows, dense and tiled."""
    lines = ["", "| model | data-parallel setting | AutoSP + SAC with | longest sequence | activation peak GiB | vs plain causal |",
             "|---|---|---|---|---|---|"]
    for name, m in res["models"].items():
        for setting, rows in m.get("masks", {}).items():
            causal = rows["causal-tiled"]["longest"]
            if not causal:  # the model does not fit in this setting at all
                continue
            for r in rows.values():
                mem = r["memory_at_longest"]
                lines.append(
                    f"| {name} | {setting} | {r['label']} | {r['longest']:,} | {mem['peak'] / GiB if mem else 0:.1f} | "
                    f"{_ratio(r['longest'], causal)} |"
                )
    return lines


def comparison(res: dict) -> list[str]:
    """Our predicted ratios next to the paper's (zero3 setting, where the paper measured)."""
    lines = ["| ratio of longest trainable sequence (zero3) | " + " | ".join(res["models"]) + " | paper |", "|---|"
             + "---|" * (len(res["models"]) + 1)]
    pairs = [
        ("AutoSP + SAC / hand-written Ulysses (eager)", "sp_sac", "ulysses_eager", f"up to {PAPER['autosp_vs_handwritten']}x"),
        ("AutoSP + SAC / AutoSP without SAC", "sp_sac", "sp", f"{PAPER['sac_vs_sp']}x"),
        ("AutoSP + SAC / the same keeping the full logits (chunked_loss=False)", "sp_sac", "sp_sac_logits", "-"),
        ("AutoSP + SAC / no SP (ZeRO-3, eager)", "sp_sac", "no_sp_eager", f"up to {PAPER['vs_zero3_8b']}x (8B)"),
        ("AutoSP + SAC / no SP (ZeRO-3, compiled)", "sp_sac", "no_sp", "-"),
        ("AutoSP + SAC / no SP (ZeRO-3, full activation checkpointing)", "sp_sac", "no_sp_ac", "-"),
    ]
    sharded = [  # AutoSP's sharded mode (fsdp=True) against the same ZeRO-3 baselines
        ("AutoSP + SAC, fsdp=True / hand-written Ulysses (ZeRO-3, eager)", "sp_sac", "ulysses_eager", "-"),
        ("AutoSP + SAC, fsdp=True / no SP (ZeRO-3, eager)", "sp_sac", "no_sp_eager", f"up to {PAPER['vs_zero3_8b']}x (8B)"),
        ("AutoSP + SAC, fsdp=True / no SP (ZeRO-3, full activation checkpointing)", "sp_sac", "no_sp_ac", "-"),
    ]
    for (label, x, y, paper), setting in [*((p, "zero3") for p in pairs), *((p, "autosp_fsdp") for p in sharded)]:
        cells = []
        for m in res["models"].values():
            xs, ys = m["settings"].get(setting, {}).get("variants"), m["settings"].get("zero3", {}).get("variants")
            cells.append(_ratio(xs[x]["longest"], ys[y]["longest"]) if xs and ys else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {paper} |")
    return lines


def plot(res: dict, path: str) -> None:
    a = res["args"]
    panels = {}
    for name, m in res["models"].items():
        static = m["settings"].get("zero3", next(iter(m["settings"].values())))["static_bytes"]
        panels[f"{name}, {a['sp_size']} GPUs"] = {
            LABELS[v]: (sorted(c), [(static + c[S]) / GiB for S in sorted(c)])
            for v, curve in m["curves"].items()
            for c in [{int(S): b for S, b in curve.items()}]  # JSON keys are strings
        }
    plot_panels(
        panels, path, "predicted GiB per GPU (ZeRO-3 static + activation peak)",
        (_gpu_gib(a) * a["usable"], "usable GPU memory"),
    )


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    return finish(run(args), args, markdown, plot)


if __name__ == "__main__":
    main()
