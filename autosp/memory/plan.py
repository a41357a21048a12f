"""``lightning-autosp plan``: will this sequence length fit, and with which arguments - before launch.

    lightning-autosp plan --config configs/llama8b_sp8_fsdp.yaml
    lightning-autosp plan --hf-config config.json --nodes 1 --gpus-per-node 8 --gpu-memory 80GiB --seq-len 131072

Memory sizes are read as written: ``GB`` is 10^9 bytes and ``GiB`` 2^30 (as ``memory_budget`` and
``benchmarks/trainability.py`` read them); the default ``--gpu-memory`` is 80GiB, what an
"80 GB" H100 or A100 holds (81,559 MiB reported), so ``80GB`` asks for 7% less.

The SP group (``--sp-size``, default: the smallest number of whole nodes, from one, whose SP group
fits ``--seq-len``; every such size is listed) splits attention as the strategy does: Ulysses
over the largest number of a node's GPUs that divides the query heads, a ring over the rest
(``--sp-layout ULYSSESxRING`` overrides it). The training step of a Llama with the run's shapes is
traced for rank 0 of its SP group and never run (:mod:`autosp.memory.model`: uninitialised weights, sizes symbolic in the length,
2- and 3-layer traces extrapolated to the full depth), once per combination of AutoSP's memory
options: SAC, tiled MLPs, activation offload, whole-block recomputation (each added in turn), and parameters replicated
(``fsdp=False``) or sharded over every GPU (``fsdp=True``). Per rank: the static memory
(parameters, gradients, optimizer states, the gathered block under ``fsdp``), what the step saves
for backward on the device per op kind, the activation peak, what offload keeps in host memory,
and the longest sequence that fits. The recommendation is the first combination, in that order,
that fits ``--seq-len``.

What is modelled: bf16 weights and activations with mixed-precision Adam (16 bytes per
parameter), one sequence per SP group, plain causal attention with a fused kernel, the fused
vocabulary loss, a liveness walk over unfused graphs (an upper bound for inductor); the CUDA
context, NCCL buffers and fragmentation are left to ``--usable`` (default 0.9 of each GPU). Models
are Llama-shaped (Llama, Mistral and Qwen2 ``config.json`` files map onto it; biases and other
families' details are not modelled).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from autosp.errors import AutoSPError
from autosp.layout import AttentionLayout, choose_attention_layout, validate_sp_layout
from autosp.models import LlamaConfig
from autosp.passes.offload import parse_bytes

__all__ = ["PlanRequest", "COMBINATIONS", "static_bytes", "longest", "limit_of", "plan", "render_text", "main"]

log = logging.getLogger(__name__)
GiB = 2**30

#: memory-model variant -> the strategy arguments it stands for, the default first, then by the memory they save
COMBINATIONS = {  # from the default (SAC) on: each adds memory savings for more time or host memory
    "sp_sac": dict(sac=True, tiled_mlp=False),
    "sp_sac_tiled": dict(sac=True, tiled_mlp=True),
    "sp_sac_offload": dict(sac=True, tiled_mlp=False, activation_offload="auto"),
    "sp_sac_tiled_offload": dict(sac=True, tiled_mlp=True, activation_offload="auto"),
    "sp_block": dict(sac="block", tiled_mlp=False),
    "sp_block_offload": dict(sac="block", tiled_mlp=False, activation_offload="auto"),
    "sp_block_tiled_offload": dict(sac="block", tiled_mlp=True, activation_offload="auto"),
}
SETTINGS = ("ddp", "autosp_fsdp")


@dataclass
class PlanRequest:
    """What ``lightning-autosp plan`` is asked."""

    model: LlamaConfig
    tied: bool = False
    seq_len: int = 131072
    nodes: int = 1
    gpus_per_node: int = 8
    sp_size: Optional[int] = None  # None: the smallest SP group of whole nodes that fits seq_len
    sp_layout: Optional[tuple[int, int]] = None  # None: as the strategy chooses
    gpu_memory: int = 80 * GiB
    host_memory: int = 2048 * GiB  # per node
    usable: float = 0.9
    granule: int = 1024
    variants: tuple[str, ...] = tuple(COMBINATIONS)
    settings: tuple[str, ...] = SETTINGS
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        world = self.nodes * self.gpus_per_node
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be 1 or more")
        if self.sp_size is None and self.sp_layout is not None:
            self.sp_size = self.sp_layout[0] * self.sp_layout[1]
        if self.sp_size is not None:
            ok = world % self.sp_size == 0 and (self.gpus_per_node % self.sp_size == 0 or self.sp_size % self.gpus_per_node == 0)
            if not ok:
                raise ValueError(
                    f"--sp-size {self.sp_size}: an SP group lies inside a node or spans whole nodes of the world "
                    f"({self.nodes} x {self.gpus_per_node} GPUs); valid: {self.sp_sizes(all_sizes=True)}"
                )
        if self.sp_layout is not None:
            try:
                self.sp_layout = validate_sp_layout(tuple(self.sp_layout), self.sp_size)
            except ValueError as exc:
                raise ValueError(f"--sp-layout {self.sp_layout[0]}x{self.sp_layout[1]}: {exc}") from None

    def sp_sizes(self, all_sizes: bool = False) -> list[int]:
        """The SP sizes to size: ``--sp-size``, else one node, two, four... up to the world
        (``all_sizes``: every valid size, for the error message)."""
        world = self.nodes * self.gpus_per_node
        if self.sp_size is not None and not all_sizes:
            return [self.sp_size]
        if all_sizes:
            return [d for d in range(1, world + 1) if world % d == 0 and (self.gpus_per_node % d == 0 or d % self.gpus_per_node == 0)]
        return [self.gpus_per_node * k for k in range(1, self.nodes + 1) if self.nodes % k == 0 and (k & (k - 1)) == 0]

    def layout(self, sp_size: int) -> AttentionLayout:
        """How an SP group of ``sp_size`` splits attention: as asked, or as the strategy chooses."""
        if self.sp_layout is not None and self.sp_layout[0] * self.sp_layout[1] == sp_size:
            return AttentionLayout(*self.sp_layout)
        return choose_attention_layout(sp_size, [self.model.n_heads], max_ulysses=self.gpus_per_node)


def static_bytes(params: dict[str, int], setting: str, world: int) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and optimizer state (mixed-precision Adam, 16 bytes
    per parameter) and the gathered working set. ``ddp``: every rank holds everything (bf16
    weights and gradients, fp32 master weights and moments); ``zero3``: the same sharded over
    ``world`` ranks plus the largest module's gathered parameters (two copies: computing and
    prefetched) and unsharded gradients; ``autosp_fsdp`` (``fsdp=True``): fp32 parameter, gradient
    and moment shards over ``world`` ranks plus the largest module gathered in bf16 and its fp32
    gradients before their reduce-scatter."""
    n, largest = params["total"], max(params["layer"], params["embedding"])
    if setting == "autosp_fsdp":
        out = {"parameters": 4 * n // world, "gradients": 4 * n // world, "optimizer": 8 * n // world}
        out["gathered"] = (2 + 4) * largest
    else:
        shard = world if setting == "zero3" else 1
        out = {"parameters": 2 * n // shard, "gradients": 2 * n // shard, "optimizer": 12 * n // shard}
        out["gathered"] = 3 * 2 * largest if setting == "zero3" else 0
    out["total"] = sum(out.values())
    return out


def longest(memory, static: int, budget: float, granule: int, limit: int = 1 << 27, host_budget: float = float("inf")) -> int:
    """The largest multiple of ``granule`` (up to ``limit``) whose step fits - on the device, and
    in the host memory a rank may fill with offloaded activations; 0 if none does."""
    def fits(S: int) -> bool:
        m = memory(S)
        return static + m["peak"] <= budget and m.get("host", 0) <= host_budget

    lo, hi = 0, limit // granule
    if not fits(granule):
        return 0
    while lo < hi:  # memory grows with S
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * granule) else (lo, mid - 1)
    return lo * granule


def limit_of(memory, static: int, host_budget: float, S: int, granule: int) -> str:
    """What stops the next length: ``"host"`` memory, or the largest term on the device:
    ``"static"`` memory, what the forward ``"saved"`` on it, or the ``"transients"`` of the peak."""
    nxt = memory(S + granule)
    if nxt.get("host", 0) > host_budget:
        return "host"
    parts = {"static": static, "saved": nxt["saved"], "transients": nxt["peak"] - nxt["saved"]}
    return max(parts, key=parts.get)


def arguments_for(variant: str, setting: str, sp_size: int, layout: AttentionLayout, explicit: bool, memory_budget: Optional[int]) -> str:
    args: dict[str, Any] = {"sp_size": sp_size}
    if explicit:
        args["sp_layout"] = (layout.ulysses, layout.ring)
    args.update({"fsdp": setting == "autosp_fsdp", **COMBINATIONS[variant]})
    if args.get("activation_offload"):
        args["memory_budget"] = f"{memory_budget / GiB:.1f}GiB"
    return "AutoSPStrategy(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"


def _rows(req: PlanRequest, sp_size: int, dtype: torch.dtype) -> dict:
    """Every combination sized for an SP group of ``sp_size``."""
    from autosp.memory import model as mm

    world = req.nodes * req.gpus_per_node
    budget = req.gpu_memory * req.usable
    host_budget = req.host_memory * req.usable / req.gpus_per_node
    params = mm.param_counts(req.model, req.tied)
    layout = req.layout(sp_size)
    explicit = req.sp_layout is not None
    granule = req.granule if req.granule % sp_size == 0 else sp_size * max(1, req.granule // sp_size)
    # offload variants read their base's traces
    models = mm.layer_models(req.model, tuple(req.variants), sp_size, dtype, sp_layout=(layout.ulysses, layout.ring))
    rows = []
    for setting in req.settings:
        static = static_bytes(params, setting, world)
        for v, m in models.items():
            S = longest(m.memory, static["total"], budget, granule, host_budget=host_budget)
            at = m.memory(req.seq_len)
            fits = static["total"] + at["peak"] <= budget and at["host"] <= host_budget
            free_for_saved = int(budget - static["total"] - (at["peak"] - at["saved"]))
            rows.append({
                "variant": v, "setting": setting, "fits": fits, "longest": S,
                "limit": limit_of(m.memory, static["total"], host_budget, S, granule),
                "static": static, "at_seq_len": at, "saved_by_kind": m.saved_by_kind(req.seq_len),
                "arguments": arguments_for(v, setting, sp_size, layout, explicit, max(0, free_for_saved)),
            })
    return {
        "sp_size": sp_size, "layout": [layout.ulysses, layout.ring], "dp_size": world // sp_size, "combinations": rows,
        "recommended": next((r for r in rows if r["fits"]), None),
    }


def plan(req: PlanRequest, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Trace, then size every combination for each SP size (:meth:`PlanRequest.sp_sizes`); the
    result is what ``--json`` prints. The plan is that of the smallest SP size whose recommended
    combination fits ``--seq-len`` (the largest when none does)."""
    from autosp.memory import model as mm

    groups = []
    for sp_size in req.sp_sizes():
        groups.append(_rows(req, sp_size, dtype))
        if groups[-1]["recommended"] is not None:
            break  # larger SP groups than one that fits only cost data parallelism
    chosen = groups[-1]
    return {
        "request": {**{k: v for k, v in asdict(req).items() if k != "model"}, "model": asdict(req.model)},
        "params": mm.param_counts(req.model, req.tied), "world": req.nodes * req.gpus_per_node,
        "budget": req.gpu_memory * req.usable, "host_budget_per_rank": req.host_memory * req.usable / req.gpus_per_node,
        "model_heads": req.model.n_heads,
        "sp_groups": [{k: g[k] for k in ("sp_size", "layout", "dp_size")} | {"longest": max(r["longest"] for r in g["combinations"])} for g in groups],
        **chosen,
    }


# ----------------------------------------------------------------------------- inputs
def _from_hf_config(path: str) -> tuple[LlamaConfig, bool]:
    with open(path) as f:
        c = json.load(f)
    try:
        cfg = LlamaConfig(
            vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
            n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"], ffn_hidden=c["intermediate_size"],
            rope_theta=float(c.get("rope_theta", 10000.0)), max_seq_len=1 << 27,
        )
    except KeyError as e:
        raise ValueError(
            f"--hf-config {path}: no {e.args[0]!r}; plan reads Llama-shaped configs (Llama, Mistral, Qwen2: hidden_size, "
            "num_hidden_layers, num_attention_heads, intermediate_size, vocab_size)."
        ) from None
    return cfg, bool(c.get("tie_word_embeddings", False))


def _from_lightning_config(path: str) -> dict[str, Any]:
    """Shapes and the layout from a LightningCLI YAML whose model is
    :class:`~lightning_autosp.examples.causal_lm.CausalLMModule` with ``model: llama``."""
    import importlib

    import yaml

    with open(path) as f:
        c = yaml.safe_load(f)
    model = c.get("model", {})
    init = model.get("init_args", {})
    if not str(model.get("class_path", "")).endswith("CausalLMModule") or init.get("model", "gpt") != "llama":
        raise ValueError(
            f"--config {path}: plan reads the shapes of lightning_autosp.examples.causal_lm.CausalLMModule with "
            "model: llama. For another model, pass its Hugging Face config.json with --hf-config and the layout with "
            "--nodes/--gpus-per-node/--sp-size/--seq-len."
        )
    data = c.get("data", {})
    data_init = data.get("init_args", {})
    vocab = init.get("vocab_size")
    if vocab is None and data.get("class_path"):
        module, _, name = data["class_path"].rpartition(".")
        vocab = getattr(getattr(importlib.import_module(module), name)(**data_init), "vocab_size", None)
    cfg = LlamaConfig(
        vocab_size=int(vocab or 32000), dim=init["dim"], n_layers=init["n_layers"], n_heads=init["n_heads"],
        n_kv_heads=init.get("n_kv_heads") or init["n_heads"], ffn_hidden=init.get("ffn_hidden") or 4 * init["dim"],
        max_seq_len=1 << 27,
    )
    trainer = c.get("trainer", {})
    strategy = (trainer.get("strategy") or {}).get("init_args", {}) if isinstance(trainer.get("strategy"), dict) else {}
    devices = trainer.get("devices", 1)
    layout = strategy.get("sp_layout")
    return dict(
        model=cfg, seq_len=data_init.get("seq_len", 4096), nodes=trainer.get("num_nodes", 1),
        gpus_per_node=devices if isinstance(devices, int) else 1, sp_size=strategy.get("sp_size"),
        sp_layout=tuple(layout) if layout is not None else None,
    )


def _layout(text: str) -> tuple[int, int]:
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected ULYSSESxRING, two integers >= 1, e.g. 4x2")
    return int(parts[0]), int(parts[1])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lightning-autosp plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="the run's LightningCLI YAML (model: CausalLMModule with model: llama)")
    src.add_argument("--hf-config", help="a Hugging Face config.json of a Llama-shaped model")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's, else 131072)")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--sp-size", type=int, help="GPUs per SP group: a divisor of a node's GPUs or whole nodes (default: the "
                   "smallest number of whole nodes that fits --seq-len)")
    p.add_argument("--sp-layout", type=_layout, help="ULYSSESxRING, e.g. 4x2 (default: Ulysses over a node's GPUs where the "
                   "heads divide, a ring over the rest)")
    p.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 80GiB (an '80 GB' GPU), 141GB; GB = 10^9 bytes, GiB = 2^30")
    p.add_argument("--host-memory", default="2048GiB", help="host memory per node, for offloaded activations")
    p.add_argument("--usable", type=float, default=0.9, help="share of each GPU a step may use")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = p.parse_args(argv)
    if not 0 < args.usable <= 1:
        p.error("--usable must be in (0, 1]")
    return args


def request_from(args: argparse.Namespace) -> PlanRequest:
    if args.hf_config:
        cfg, tied = _from_hf_config(args.hf_config)
        found: dict[str, Any] = dict(model=cfg, tied=tied)
    else:
        found = _from_lightning_config(args.config)
    for name in ("seq_len", "nodes", "gpus_per_node", "sp_size", "sp_layout"):
        if getattr(args, name) is not None:
            found[name] = getattr(args, name)
    found = {k: v for k, v in found.items() if v is not None}
    return PlanRequest(
        **found, gpu_memory=parse_bytes(args.gpu_memory, "--gpu-memory"), host_memory=parse_bytes(args.host_memory, "--host-memory"),
        usable=args.usable,
    )


# ----------------------------------------------------------------------------- output
def _gib(b: float) -> str:
    return f"{b / GiB:.1f}"


#: the combinations table: (header, width); 76 columns with single spaces between them
_COLUMNS = (("fsdp", 4), ("rec.", 6), ("tiles", 5), ("off", 3), ("static", 6), ("saved", 6), ("trans.", 6), ("host", 6),
            ("fits", 4), ("longest", 10), ("limit", 10))


def _line(cells: list[str]) -> str:
    out = []
    for (header, width), cell in zip(_COLUMNS, cells):
        right = header in ("static", "saved", "trans.", "host", "longest")
        out.append(cell.rjust(width) if right else cell.ljust(width))
    return " ".join(out).rstrip()


def render_text(res: dict) -> str:
    """The plan as plain text of at most 80 columns (a terminal, a log file, a CI job's output)."""
    req, n = res["request"], res["params"]["total"]
    size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
    u, r = res["layout"]
    lines = [
        f"{size} parameters, {res['model_heads']} heads, {req['seq_len']:,} tokens per sequence.",
        *textwrap.wrap(
            f"{req['nodes']} node(s) x {req['gpus_per_node']} GPUs of {_gib(req['gpu_memory'])} GiB (a step may use "
            f"{req['usable']:.0%}), {_gib(req['host_memory'])} GiB of host memory per node.", 80,
        ),
        "",
        "SP groups (the longest sequence with the best combination below):",
    ]
    for g in res["sp_groups"]:
        gu, gr = g["layout"]
        how = f"ulysses={gu} x ring={gr}" + (" (Ulysses alone)" if gr == 1 else "")
        lines.append(f"  sp_size={g['sp_size']:<4} dp={g['dp_size']:<3} {how:<32} longest {g['longest']:>12,}")
    lines += [
        "",
        f"sp_size={res['sp_size']} as ulysses={u} x ring={r}: per rank at {req['seq_len']:,} tokens, GiB",
        _line([h for h, _ in _COLUMNS]),
    ]
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    for row in res["combinations"]:
        a, opts = row["at_seq_len"], COMBINATIONS[row["variant"]]
        lines.append(_line([
            yes(row["setting"] == "autosp_fsdp"), {True: "SAC", False: "no", "block": "blocks"}[opts["sac"]],
            yes(opts.get("tiled_mlp")), yes(opts.get("activation_offload")), _gib(row["static"]["total"]), _gib(a["saved"]),
            _gib(a["peak"] - a["saved"]), _gib(a["host"] * req["gpus_per_node"]), yes(row["fits"]), f"{row['longest']:,}",
            row["limit"],
        ]))
    lines.append("rec.: recomputed in backward (SAC: matmuls and norms; blocks: whole blocks);")
    lines.append("tiles: tiled MLPs; off: activation offload; trans.: transients at the peak;")
    lines.append("host: host memory per node; limit: what stops the next length.")
    rec = res["recommended"]
    lines.append("")
    if rec is None:
        lines.append(f"Nothing fits {req['seq_len']:,} tokens: use more nodes, GPUs with more memory or shorter sequences.")
        return "\n".join(lines)
    kinds = ", ".join(f"{k} {_gib(v)}" for k, v in rec["saved_by_kind"].items() if v)
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in rec["static"].items() if k != "total")
    lines += [
        *textwrap.wrap(f"Static per rank, GiB: {parts}.", 80),
        *textwrap.wrap(f"Saved on the device per op kind, per rank, GiB: {kinds or 'none'}.", 80),
        *textwrap.wrap(f"Recommended: {rec['arguments']}", 80, subsequent_indent="  "),
    ]
    if r > 1 and "sp_layout" not in rec["arguments"]:
        lines.append(f"  (the strategy lays sp_size={res['sp_size']} out as ulysses={u} x ring={r} itself)")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> Optional[dict]:
    """The command: the plan as text (``--json``: as JSON), or one line naming what is wrong
    (exit status 2) - never a traceback for a request it cannot answer."""
    args = parse_args(argv)
    try:
        with warnings.catch_warnings():  # Lightning's pytree deprecation notes, raised by torch's graph copies
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
            res = plan(request_from(args))
    except (ValueError, AutoSPError) as exc:
        sys.stderr.write(f"lightning-autosp plan: error: {exc}\n")
        raise SystemExit(2) from None
    out = json.dumps(res, indent=1, default=str) if args.json else render_text(res)
    sys.stdout.write(out + "\n")  # the command's output, not a log
    return res
