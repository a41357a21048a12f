"""The strategies' shared arguments, checked once (both strategies take the same ones).

:func:`check_arguments` turns ``AutoSPStrategy(...)``'s compile, SAC, sequence and sharding
arguments into a :class:`~autosp.steps.StepConfig` and an optional
:class:`~autosp.modes.sharded.config.FSDPConfig`, or raises a ``ValueError`` naming the argument and
the fix. Nothing is lost on a bad value: it is raised before anything is built.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from autosp.backend import AOT_BACKENDS, SUPPORTED_BACKENDS
from autosp.modes.sharded.config import FSDPConfig
from autosp.layout import validate_sp_layout, validate_sp_size
from autosp.passes.offload import OffloadConfig, parse_bytes
from autosp.passes.sac import SACConfig
from autosp.steps import StepConfig

__all__ = ["check_arguments"]


def check_arguments(
    sp_size: Optional[int], compile_backend: str, sac: Union[bool, str], sac_recompute: Sequence[str], sac_memory_budget: float,
    seq_dim: int, fsdp: Union[bool, str], param_dtype: Optional[Union[str, torch.dtype]],
    reduce_dtype: Optional[Union[str, torch.dtype]], pretrained: Optional[dict[str, str]], chunked_loss: Union[bool, int],
    tiled_attention: Union[bool, int] = True, strict: bool = False, activation_offload: Union[bool, str] = "auto",
    memory_budget: Optional[Union[int, float, str]] = None, tiled_mlp: Union[bool, int] = True,
    sp_layout: Optional[Sequence[int]] = None,
) -> tuple[StepConfig, Optional[FSDPConfig]]:
    validate_sp_size(sp_size)
    layout = None if sp_layout is None else validate_sp_layout(sp_layout, sp_size)
    if compile_backend not in SUPPORTED_BACKENDS:
        raise ValueError(f"AutoSPStrategy(compile_backend={compile_backend!r}): choose one of {list(SUPPORTED_BACKENDS)}.")
    if sac not in (True, False, "block"):
        raise ValueError(
            f"AutoSPStrategy(sac={sac!r}): pass True (recompute matmuls and norms, keep attention), 'block' (recompute "
            "every transformer block whole from its input, attention included: the least memory) or False."
        )
    if sac and compile_backend not in AOT_BACKENDS:
        raise ValueError(
            f"AutoSPStrategy(compile_backend={compile_backend!r}, sac=True): sequence-aware activation "
            f"checkpointing partitions the AOT joint graph, which only {list(AOT_BACKENDS)} build "
            f"({compile_backend!r} keeps autograd eager). Pass sac=False to compile with {compile_backend!r}, "
            "or compile_backend='aot_eager' or 'inductor' to keep SAC."
        )
    fsdp_config = FSDPConfig.from_arguments(fsdp, param_dtype, reduce_dtype)
    if pretrained is not None and (fsdp_config is None or not isinstance(pretrained, dict)):
        raise ValueError(
            f"AutoSPStrategy(pretrained={pretrained!r}): pass a dict from a LightningModule attribute built in "
            "configure_model to its weights ({'model': '/path/to/hf_model_dir'}; '' for the LightningModule itself), "
            "with fsdp=True or 'hybrid': each rank then reads only its shards."
        )
    if not isinstance(seq_dim, int) or seq_dim < 1:
        raise ValueError(f"AutoSPStrategy(seq_dim={seq_dim!r}): the sequence dim must be an int >= 1 (dim 0 is the batch).")
    if not isinstance(chunked_loss, bool) and not (isinstance(chunked_loss, int) and chunked_loss > 0):
        raise ValueError(
            f"AutoSPStrategy(chunked_loss={chunked_loss!r}): pass True (chunks sized from the vocabulary), "
            "a positive number of tokens per chunk, or False (keep the full logits)."
        )
    loss_chunk: Optional[int] = (0 if chunked_loss else None) if isinstance(chunked_loss, bool) else chunked_loss
    if not isinstance(tiled_attention, bool) and not (isinstance(tiled_attention, int) and tiled_attention >= 8):
        raise ValueError(
            f"AutoSPStrategy(tiled_attention={tiled_attention!r}): pass True (tiles sized automatically), the "
            "query rows and key columns per tile (an int >= 8), or False (keep masks as dense S x S tensors)."
        )
    attention_tile: Optional[int] = (0 if tiled_attention else None) if isinstance(tiled_attention, bool) else tiled_attention
    if not isinstance(tiled_mlp, bool) and not (isinstance(tiled_mlp, int) and tiled_mlp >= 1):
        raise ValueError(
            f"AutoSPStrategy(tiled_mlp={tiled_mlp!r}): pass True (MLPs run over tiles of rows sized automatically, where "
            "a rank holds two tiles or more), the rows per tile (an int >= 1), or False (MLPs run whole)."
        )
    mlp_tile: Optional[int] = (0 if tiled_mlp else None) if isinstance(tiled_mlp, bool) else tiled_mlp
    if not isinstance(strict, bool):
        raise ValueError(
            f"AutoSPStrategy(strict={strict!r}): pass True (an op AutoSP would run replicated, all-gathering the "
            "sequence, is an error) or False (it runs replicated, with a warning when it is large)."
        )
    sac_config = SACConfig(recompute=tuple(sac_recompute), memory_budget=sac_memory_budget)  # checked even when off
    offload = _offload_config(activation_offload, memory_budget, compile_backend)
    if sac == "block":
        sac_config = SACConfig(recompute=sac_config.recompute, memory_budget=sac_config.memory_budget, block=True)
    if layout is not None and layout[1] > 1 and attention_tile is None:
        raise ValueError(
            f"AutoSPStrategy(sp_layout={tuple(layout)}, tiled_attention=False): a ring level computes attention in the tiled "
            "kernel, block by block; pass tiled_attention=True (or a tile size), or a layout without a ring."
        )
    step = StepConfig(
        compile_backend, sac_config if sac else None, seq_dim, loss_chunk, attention_tile, strict, offload, mlp_tile, layout,
    )
    return step, fsdp_config


def _offload_config(
    activation_offload: Union[bool, str], memory_budget: Optional[Union[int, float, str]], compile_backend: str
) -> Optional[OffloadConfig]:
    if activation_offload not in (True, False, "auto"):
        raise ValueError(
            f"AutoSPStrategy(activation_offload={activation_offload!r}): pass 'auto' (saved activations go to host "
            "memory only as far as memory_budget requires), True (all of them) or False (none)."
        )
    budget = None if memory_budget is None else parse_bytes(memory_budget, "AutoSPStrategy(memory_budget)")
    if activation_offload is False or (activation_offload == "auto" and budget is None):
        return None
    if compile_backend not in AOT_BACKENDS:
        raise ValueError(
            f"AutoSPStrategy(compile_backend={compile_backend!r}, activation_offload={activation_offload!r}, "
            f"memory_budget={memory_budget!r}): activation offload rewrites the partitioned forward and backward graphs, "
            f"which only {list(AOT_BACKENDS)} build. Use one of them, or activation_offload=False."
        )
    return OffloadConfig(activation_offload, budget)
