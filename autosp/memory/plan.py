"""``lightning-autosp plan``: will this sequence length fit, and with which arguments - before launch.

    lightning-autosp plan --config configs/llama8b_sp8_fsdp.yaml
    lightning-autosp plan --hf-config config.json --nodes 1 --gpus-per-node 8 --gpu-memory 80GB --seq-len 131072

The training step of a Llama with the run's shapes is traced for rank 0 of its SP group and never
run (:mod:`autosp.memory.model`: uninitialised weights, sizes symbolic in the length,
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
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

import torch

from autosp.models import LlamaConfig
from autosp.passes.offload import parse_bytes

__all__ = ["PlanRequest", "COMBINATIONS", "static_bytes", "longest", "limit_of", "plan", "main"]

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
    sp_size: Optional[int] = None  # None: the GPUs of a node
    gpu_memory: int = 80 * 10**9
    host_memory: int = 2048 * GiB  # per node
    usable: float = 0.9
    granule: int = 1024
    variants: tuple[str, ...] = tuple(COMBINATIONS)
    settings: tuple[str, ...] = SETTINGS
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sp_size = self.sp_size or self.gpus_per_node
        if self.gpus_per_node % self.sp_size:
            raise ValueError(f"--sp-size {self.sp_size} must divide --gpus-per-node {self.gpus_per_node}")
        if self.granule % self.sp_size:
            self.granule = self.sp_size * max(1, self.granule // self.sp_size)


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


def longest(memory, static: int, budget: float, granule: int, limit: int = 1 << 24, host_budget: float = float("inf")) -> int:
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


def arguments_for(variant: str, setting: str, sp_size: int, memory_budget: Optional[int]) -> str:
    args: dict[str, Any] = {"sp_size": sp_size, "fsdp": setting == "autosp_fsdp", **COMBINATIONS[variant]}
    if args.get("activation_offload"):
        args["memory_budget"] = f"{memory_budget / 10**9:.1f}GB"
    return "AutoSPStrategy(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"


def plan(req: PlanRequest, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Trace, then size every combination; the result is what ``--json`` prints."""
    from autosp.memory import model as mm

    world = req.nodes * req.gpus_per_node
    budget = req.gpu_memory * req.usable
    host_budget = req.host_memory * req.usable / req.gpus_per_node
    params = mm.param_counts(req.model, req.tied)
    models = mm.layer_models(req.model, tuple(req.variants), req.sp_size, dtype)  # offload variants read their base's traces
    rows = []
    for setting in req.settings:
        static = static_bytes(params, setting, world)
        for v, m in models.items():
            S = longest(m.memory, static["total"], budget, req.granule, host_budget=host_budget)
            at = m.memory(req.seq_len)
            fits = static["total"] + at["peak"] <= budget and at["host"] <= host_budget
            free_for_saved = int(budget - static["total"] - (at["peak"] - at["saved"]))
            rows.append({
                "variant": v, "setting": setting, "fits": fits, "longest": S,
                "limit": limit_of(m.memory, static["total"], host_budget, S, req.granule),
                "static": static, "at_seq_len": at, "saved_by_kind": m.saved_by_kind(req.seq_len),
                "arguments": arguments_for(v, setting, req.sp_size, max(0, free_for_saved)),
            })
    chosen = next((r for r in rows if r["fits"]), None)
    return {
        "request": {**{k: v for k, v in asdict(req).items() if k != "model"}, "model": asdict(req.model)},
        "params": params, "world": world, "budget": budget, "host_budget_per_rank": host_budget,
        "combinations": rows, "recommended": chosen,
    }


# ----------------------------------------------------------------------------- inputs
def _from_hf_config(path: str) -> tuple[LlamaConfig, bool]:
    with open(path) as f:
        c = json.load(f)
    try:
        cfg = LlamaConfig(
            vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
            n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"], ffn_hidden=c["intermediate_size"],
            rope_theta=float(c.get("rope_theta", 10000.0)), max_seq_len=1 << 24,
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
        max_seq_len=1 << 24,
    )
    trainer = c.get("trainer", {})
    strategy = (trainer.get("strategy") or {}).get("init_args", {}) if isinstance(trainer.get("strategy"), dict) else {}
    devices = trainer.get("devices", 1)
    return dict(
        model=cfg, seq_len=data_init.get("seq_len", 4096), nodes=trainer.get("num_nodes", 1),
        gpus_per_node=devices if isinstance(devices, int) else 1, sp_size=strategy.get("sp_size"),
    )


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lightning-autosp plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="the run's LightningCLI YAML (model: CausalLMModule with model: llama)")
    src.add_argument("--hf-config", help="a Hugging Face config.json of a Llama-shaped model")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's, else 131072)")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--sp-size", type=int, help="GPUs per SP group (default: a node's)")
    p.add_argument("--gpu-memory", default="80GB", help="memory per GPU, e.g. 80GB, 141GB")
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
    for name in ("seq_len", "nodes", "gpus_per_node", "sp_size"):
        if getattr(args, name) is not None:
            found[name] = getattr(args, name)
    found = {k: v for k, v in found.items() if v is not None}
    return PlanRequest(
        **found, gpu_memory=parse_bytes(args.gpu_memory, "--gpu-memory"), host_memory=parse_bytes(args.host_memory, "--host-memory"),
        usable=args.usable,
    )


# ----------------------------------------------------------------------------- output
def _size(b: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def render(res: dict) -> None:
    """Rich tables, like Lightning's model summary."""
    from rich.console import Console
    from rich.table import Table

    req = res["request"]
    console = Console()
    n = res["params"]["total"]
    title = (
        f"{n / 1e9:.2f} B parameters," if n >= 1e9 else f"{n / 1e6:.1f} M parameters,"
    ) + (
        f" {req['seq_len']:,} tokens, {req['nodes']} node(s) x "
        f"{req['gpus_per_node']} GPUs of {req['gpu_memory'] / 10**9:.0f} GB (a step may use {req['usable']:.0%}), sp_size={req['sp_size']}"
    )
    table = Table(title=title, caption="per rank at the length asked: static memory, saved for backward on the device, transients at the peak; host: offloaded, per node")
    for col in ("fsdp", "recompute", "tiled MLP", "offload", "static", "saved", "transients", "host", "fits", "longest", "limited by"):
        table.add_column(col, justify="right" if col in ("static", "saved", "transients", "host", "longest") else "left")
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    for r in res["combinations"]:
        a, opts = r["at_seq_len"], COMBINATIONS[r["variant"]]
        table.add_row(
            yes(r["setting"] == "autosp_fsdp"), {True: "SAC", False: "no", "block": "blocks"}[opts["sac"]], yes(opts.get("tiled_mlp")), yes(opts.get("activation_offload")),
            _size(r["static"]["total"]), _size(a["saved"]), _size(a["peak"] - a["saved"]), _size(a["host"] * req["gpus_per_node"]),
            yes(r["fits"]), f"{r['longest']:,}", r["limit"],
        )
    console.print(table)
    rec = res["recommended"]
    if rec is None:
        console.print(f"Nothing fits {req['seq_len']:,} tokens: use more GPUs per SP group or shorter sequences.")
        return
    kinds = ", ".join(f"{k} {_size(v)}" for k, v in rec["saved_by_kind"].items() if v)
    parts = ", ".join(f"{k} {_size(v)}" for k, v in rec["static"].items() if k != "total")
    console.print(f"Static per rank: {parts}.")
    console.print(f"Saved on the device per op kind, per rank: {kinds or 'none'}.")
    console.print(f"Recommended: {rec['arguments']}")


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    res = plan(request_from(args))
    if args.json:
        sys.stdout.write(json.dumps(res, indent=1, default=str) + "\n")  # the command's output, not a log
    else:
        render(res)
    return res
