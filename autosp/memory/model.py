"""Per-rank training memory of a Llama at any sequence length, from traced graphs.

The model is traced, never run: it is built with uninitialised weights, one training step is
captured by Dynamo with the sequence length marked dynamic, rewritten (or not) by the AutoSP
pass for rank 0 of an SP group, and partitioned by AOT autograd into a forward and a backward
graph. Compilation is stopped before anything executes, and no process group is needed (the
collectives only have to be traced, which their fake kernels do). Sizes in the graphs are
expressions of the sequence length, so one trace answers every length.

From the two graphs (:mod:`autosp.memory.walk`):

* **saved**: the bytes the forward keeps for backward (each allocation once, views resolved);
* **peak**: a liveness walk over the forward and then the backward graph (parameter gradients
  are left to the static memory, which ``trainability.py`` and ``plan`` count); an upper bound
  for a compiled run.

An SP group laid out with a ring level (``sp_layout=(ulysses, ring)``, or the pass's default for
the heads) is traced as such: the ring's exchanges and kernel, with its blocks in flight.

Layers are identical, so a model of ``n`` layers is traced with 2 and 3 layers and every
quantity extrapolated linearly (``q(n) = q(2) + (n - 2) * (q(3) - q(2))``); the benchmarks
compare that with a 4-layer trace. (The first block is not like the others: with the fused
loss the backward's peak of a 1-layer model sits elsewhere, which made 1- and 2-layer traces
under-predict the backward peak by 2%.)

Variants (``VARIANTS``):

``no_sp_eager``     no SP, what eager autograd saves (AOT's default partition: saves every
                    intermediate eager autograd keeps)
``no_sp``           no SP, compiled (PyTorch's min-cut partition)
``no_sp_ac``        no SP, compiled, every transformer block under
                    ``torch.utils.checkpoint`` (full activation checkpointing: the usual
                    way to train long sequences without SP, recomputing attention too)
``ulysses_eager``   Ulysses SP, saving what eager autograd saves: the memory of hand-written
                    Ulysses run in eager mode (same all-to-alls, same shapes; k and v
                    exchanged after the model's repeat of the KV heads, as attention reads them)
``sp``              AutoSP without SAC (min-cut partition)
``sp_sac``          AutoSP with sequence-aware activation checkpointing
``sp_sac_logits``   the same with ``chunked_loss=False``: the full logits are kept
``sp_sac_tiled``    AutoSP + SAC with each MLP over tiles of rows (``tiled_mlp=True``, tiles
                    sized automatically): the walk adds one tile's working memory at its ops
``sp_sac_offload``  AutoSP + SAC with every saved activation in host memory between forward and
                    backward (``activation_offload=True``): counted apart, as ``host``
``sp_sac_tiled_offload``  both
``sp_block``        AutoSP with every transformer block recomputed whole in backward
                    (``sac="block"``: only what each block hands on is saved)
``sp_block_offload``  the same with those saved in host memory (DeepSpeed ALST's scheme)
``sp_block_tiled``, ``sp_block_tiled_offload``  the same with tiled MLPs
AutoSP variants (``sp``, ``sp_sac``) compute the loss with the fused, chunked vocabulary
projection (``chunked_loss=True``, the default); the walk adds its working memory (one
chunk's logits and their gradient, the fp32 weight-gradient accumulator) at that op.

Masks (``MASKS``, :func:`trace`'s ``mask``): ``causal`` (``is_causal=True``, the default),
``documents`` (packed documents: the model compares document ids) and ``window`` (a sliding
window), the last two with the mask built in the model from positions, as a ``[1, 1, S, S]``
tensor (``tiled=False``: what ``AutoSPStrategy(tiled_attention=False)`` keeps) or evaluated per
tile (the default); the walk adds the tiled kernel's working memory at its ops.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

from autosp.memory.walk import Trace, Walk, walk
from autosp.models import Llama, LlamaConfig
from autosp.passes import sequence_parallel_pass
from autosp.passes.offload import OffloadConfig
from autosp.passes.sac import SACConfig, SACPartitioner
from autosp.passes.tiled_mlp import tile_token_regions

__all__ = [
    "PRESETS", "VARIANTS", "MASKS", "Trace", "trace", "traces", "Walk", "walk", "LayerModel", "layer_model", "layer_models",
    "param_counts",
]

#: Published shapes (Hugging Face ``config.json``). Llama-3.2-1B ties its input embedding and
#: output head; the bundled model has an untied head, which only adds one vocab x dim matrix
#: of *parameters* (counted once below when ``tied``), never activations.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        config=dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192, rope_theta=5e5),
        tied=True,
    ),
    "llama-3.1-8b": dict(
        config=dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, rope_theta=5e5),
        tied=False,
    ),
}

VARIANTS = (
    "no_sp_eager", "no_sp", "no_sp_ac", "ulysses_eager", "sp", "sp_sac", "sp_sac_logits", "sp_sac_tiled", "sp_sac_offload",
    "sp_sac_tiled_offload", "sp_block", "sp_block_offload", "sp_block_tiled", "sp_block_tiled_offload",
)
MASKS = ("causal", "documents", "window")
#: documents and window of the ``documents`` and ``window`` masks (tokens); neither changes memory
DOCUMENT_TOKENS, WINDOW_TOKENS = 8192, 4096
#: variants that use the fused vocabulary loss (``AutoSPStrategy(chunked_loss=True)``)
FUSED_LOSS_VARIANTS = (
    "sp", "sp_sac", "sp_sac_tiled", "sp_sac_offload", "sp_sac_tiled_offload", "sp_block", "sp_block_offload", "sp_block_tiled",
    "sp_block_tiled_offload",
)


class _Checkpointed(torch.nn.Module):
    """A transformer block under non-reentrant activation checkpointing."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False)


def keep_rope_fp32(model: Llama) -> Llama:
    """``module.to(bf16)`` casts the rotary frequencies too; put them back in fp32 (as built)."""
    cfg = model.config
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    model.inv_freq = inv.to(model.inv_freq.device)
    return model


class _Traced(Exception):
    """Raised by the tracing backend once the graphs exist, so that nothing runs."""


def _partitioner(variant: str, offload_pass: bool) -> SACPartitioner:
    """How ``variant`` partitions (``*_eager`` variants: as eager autograd saves)."""
    return SACPartitioner(
        SACConfig(block=variant.startswith("sp_block")) if variant.startswith(("sp_sac", "sp_block")) else None,
        partition_fn=default_partition if variant.endswith("_eager") else min_cut_rematerialization_partition,
        checked=variant != "no_sp_ac",  # full activation checkpointing recomputes attention by design
        offload=OffloadConfig(True) if offload_pass else None,
    )


def _capture(variant: str) -> str:
    """Variants with the same capture differ only in the partition: SAC or whole blocks."""
    return variant.replace("sp_block", "sp_sac")


def _backend(
    variants: tuple[str, ...], sp_size: int, out: list, native_gqa: Optional[bool] = False, tiled: bool = True, mlp_tile: int = 0,
    offload_pass: bool = False, sp_layout: Optional[tuple[int, int]] = None,
) -> Callable:
    """A backend that rewrites the step like ``variants[0]`` (all of one :func:`_capture`),
    partitions its joint graph once per variant, appends ``(fw, bw, num_fwd_outputs)`` to ``out``
    for each and stops the compile."""
    variant = variants[0]
    partitioners = [_partitioner(v, offload_pass) for v in variants]

    def keep_graphs(gm: fx.GraphModule, joint_inputs: list, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        # each partition gets its own copy: tagging and the partitioner edit the joint graph
        copies = [fx.GraphModule(gm, copy.deepcopy(gm.graph)) for _ in partitioners[1:]] + [gm]
        for partitioner, joint in zip(partitioners, copies):
            fw, bw = partitioner(joint, joint_inputs, **kwargs)
            out.append((fw, bw, kwargs["num_fwd_outputs"]))
        return fw, bw

    def backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
        if "tiled" in variant:
            tile_token_regions(gm, tile=mlp_tile)  # 0: sized automatically (tiled_mlp=True), at any length
        if variant.startswith(("sp", "ulysses")):
            chunk = 0 if variant in FUSED_LOSS_VARIANTS else None
            gm = sequence_parallel_pass(
                gm, example_inputs, sp_size=sp_size, sp_rank=0, group_name="traced", seq_dim=1, loss_chunk=chunk,
                kv_before_repeat=not variant.startswith("ulysses"),  # hand-written: k, v exchanged as attention reads them
                native_gqa=native_gqa, attention_tile=0 if tiled else None, sp_layout=sp_layout,
            )
        aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=keep_graphs)(gm, example_inputs)
        raise _Traced

    return backend


def trace(
    cfg: LlamaConfig, variant: str, sp_size: int = 8, dtype: torch.dtype = torch.bfloat16, S: int = 8192,
    native_gqa: Optional[bool] = False, mask: str = "causal", tiled: bool = True, mlp_tile: int = 0,
    offload_pass: bool = False, sp_layout: Optional[tuple[int, int]] = None,
) -> Trace:
    """Trace one training step (forward + token-mean cross-entropy) of ``Llama(cfg)``, with
    attention under ``mask`` (:data:`MASKS`; ``tiled``: evaluated per tile by AutoSP's variants).

    ``native_gqa`` is the SP pass's argument: ``False`` (default) models AutoSP on a GPU, where
    KV heads exchanged before the model's repeat are repeated again before attention; ``None``
    models it where the traced tensors are (CPU: attention reads them unrepeated).

    The weights are real CPU tensors left uninitialised (``to_empty``), so that the CPU
    attention kernel (which, like flash attention, keeps only the output and the log-sum-exp)
    is the one traced; they are never read. ``S`` only seeds the trace: the length is dynamic.
    ``mlp_tile``: rows per tile of the ``*tiled*`` variants (0: sized automatically).
    The ``*_offload`` variants are their base variant's trace read with every saved tensor
    offloaded (:func:`walk`); ``offload_pass`` traces them through AutoSP's offload pass instead.
    ``sp_layout``: ``(ulysses, ring)`` of the SP group (``None``: the pass's default for the heads).
    """
    return traces(cfg, (variant,), sp_size, dtype, S, native_gqa, mask, tiled, mlp_tile, offload_pass, sp_layout)[variant]


def traces(
    cfg: LlamaConfig, variants: tuple[str, ...], sp_size: int = 8, dtype: torch.dtype = torch.bfloat16, S: int = 8192,
    native_gqa: Optional[bool] = False, mask: str = "causal", tiled: bool = True, mlp_tile: int = 0,
    offload_pass: bool = False, sp_layout: Optional[tuple[int, int]] = None,
) -> dict[str, Trace]:
    """:func:`trace` of each of ``variants``; variants that differ only in the partition (SAC or
    whole blocks, offloaded or not) share one capture."""
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {v!r}")
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}, got {mask!r}")
    base = {v: v.removesuffix("_offload") if v.endswith("_offload") and not offload_pass else v for v in variants}
    groups: dict[str, list[str]] = {}
    for b in dict.fromkeys(base.values()):
        groups.setdefault(_capture(b), []).append(b)
    found: dict[str, Trace] = {}
    for group in groups.values():
        graphs = _trace_step(cfg, tuple(group), sp_size, dtype, S, native_gqa, mask, tiled, mlp_tile, offload_pass, sp_layout)
        found.update({b: Trace(fw=fw, bw=bw, num_fwd_outputs=n) for b, (fw, bw, n) in zip(group, graphs)})
    return {
        v: found[b] if b == v else Trace(fw=found[b].fw, bw=found[b].bw, num_fwd_outputs=found[b].num_fwd_outputs, offload=True)
        for v, b in base.items()
    }


def _trace_step(
    cfg: LlamaConfig, variants: tuple[str, ...], sp_size: int, dtype: torch.dtype, S: int, native_gqa: Optional[bool], mask: str,
    tiled: bool, mlp_tile: int, offload_pass: bool, sp_layout: Optional[tuple[int, int]] = None,
) -> list:
    if mask == "window":
        cfg = replace(cfg, sliding_window=WINDOW_TOKENS)
    with torch.device("meta"):
        model = Llama(cfg)
    model = keep_rope_fp32(model.to(dtype).to_empty(device="cpu"))  # cast on meta: no full-size copy
    if variants[0] == "no_sp_ac":
        model.layers = torch.nn.ModuleList(_Checkpointed(b) for b in model.layers)

    def step(ids, labels, docs):
        logits = model(ids, document_ids=docs if mask == "documents" else None)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))

    ids = torch.zeros(1, S, dtype=torch.long)
    labels = torch.zeros(1, S, dtype=torch.long)
    docs = (torch.arange(S) // DOCUMENT_TOKENS)[None]
    for t in (ids, labels, docs):
        torch._dynamo.mark_dynamic(t, 1)
    graphs: list = []
    torch._dynamo.reset()
    try:
        backend = _backend(variants, sp_size, graphs, native_gqa, tiled, mlp_tile, offload_pass, sp_layout)
        torch.compile(step, backend=backend, fullgraph=True)(ids, labels, docs)
    except Exception as e:  # Dynamo wraps the backend's exception
        if len(graphs) < len(variants) or not _caused_by(e, _Traced):
            raise
    return graphs[-len(variants):]


def _caused_by(e: BaseException, cls: type) -> bool:
    while e is not None:
        if isinstance(e, cls):
            return True
        e = e.__cause__ or e.__context__
    return False


@dataclass
class LayerModel:
    """Activation memory of an ``n``-layer model from traces of ``base`` and ``base + 1``
    layers (:data:`BASE_LAYERS`)."""

    low: Trace
    high: Trace
    n_layers: int
    base: int = 2

    def memory(self, S: int, n_layers: Optional[int] = None, count_grads: bool = False) -> dict[str, int]:
        n = self.n_layers if n_layers is None else n_layers
        a, b = self.low.memory(S, count_grads), self.high.memory(S, count_grads)
        return {k: a[k] + (n - self.base) * (b[k] - a[k]) for k in a}

    def saved_by_kind(self, S: int, n_layers: Optional[int] = None) -> dict[str, int]:
        n = self.n_layers if n_layers is None else n_layers
        a, b = self.low.saved_by_kind(S), self.high.saved_by_kind(S)
        return {k: a[k] + (n - self.base) * (b[k] - a[k]) for k in a}


#: the shallower of the two traced depths. The first block differs (its backward's peak sits
#: differently once the loss no longer dominates), so 2 and 3 layers, not 1 and 2.
BASE_LAYERS = 2


def layer_model(
    cfg: LlamaConfig, variant: str, sp_size: int = 8, dtype: torch.dtype = torch.bfloat16, mask: str = "causal", tiled: bool = True,
    mlp_tile: int = 0, sp_layout: Optional[tuple[int, int]] = None,
) -> LayerModel:
    return layer_models(cfg, (variant,), sp_size, dtype, mask, tiled, mlp_tile, sp_layout)[variant]


def layer_models(
    cfg: LlamaConfig, variants: tuple[str, ...], sp_size: int = 8, dtype: torch.dtype = torch.bfloat16, mask: str = "causal",
    tiled: bool = True, mlp_tile: int = 0, sp_layout: Optional[tuple[int, int]] = None,
) -> dict[str, LayerModel]:
    """:func:`layer_model` of each of ``variants``, sharing captures (:func:`traces`)."""
    low, high = (
        traces(replace(cfg, n_layers=n), tuple(variants), sp_size, dtype, mask=mask, tiled=tiled, mlp_tile=mlp_tile, sp_layout=sp_layout)
        for n in (BASE_LAYERS, BASE_LAYERS + 1)
    )
    return {v: LayerModel(low=low[v], high=high[v], n_layers=cfg.n_layers, base=BASE_LAYERS) for v in variants}


def param_counts(cfg: LlamaConfig, tied: bool) -> dict[str, int]:
    """``total``, ``layer`` (one transformer block) and ``embedding`` parameter counts."""
    with torch.device("meta"):
        one = Llama(replace(cfg, n_layers=1))
    layer = sum(p.numel() for p in one.layers[0].parameters())
    embedding = cfg.vocab_size * cfg.dim
    total = sum(p.numel() for p in one.parameters()) + (cfg.n_layers - 1) * layer - (embedding if tied else 0)
    return {"total": total, "layer": layer, "embedding": embedding}
