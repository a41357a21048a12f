"""A hand-written DeepSpeed-Ulysses baseline for the bundled Llama.

This is the code AutoSP saves users from writing: the model is changed by hand so that each
attention module receives its rank's slice of the sequence, exchanges q, k and v with an
all-to-all (``[B, H, S/P, D] -> [B, H/P, S, D]``: scatter heads, gather the sequence), runs
attention on the full sequence for its ``H/P`` heads, and exchanges the output back. The
caller feeds each rank its slice of the tokens with its global ``position_ids``, scales the
loss by the global token count and sums gradients over the SP group - what DeepSpeed's
``DistributedAttention`` and its training loops do.

Two implementations of the exchange (``impl``):

``"deepspeed"``  DeepSpeed's own ``deepspeed.sequence.layer.DistributedAttention`` wrapped
                 around the local attention, in its ``[B, S, H, D]`` layout (needs
                 ``pip install deepspeed``; ``DS_BUILD_OPS=0`` is enough, nothing is
                 compiled for CUDA). This is the hand-written Ulysses the field uses.
``"funcol"``     the same algorithm written here with torch's autograd-aware functional
                 all-to-all, for machines without DeepSpeed.

Both run in eager mode and under a plain ``torch.compile``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

from autosp.models.llama import Attention, Llama, apply_rotary, repeat_kv

__all__ = ["UlyssesAttention", "ulyssesify", "local_shard", "ulysses_loss", "default_impl", "init_deepspeed"]


def default_impl() -> str:
    """``"deepspeed"`` when DeepSpeed imports, else ``"funcol"``."""
    try:
        import deepspeed.sequence.layer  # noqa: F401
    except ImportError:
        return "funcol"
    return "deepspeed"


def init_deepspeed() -> str:
    """Let ``deepspeed.comm`` wrap the already initialised torch process group; returns its version."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())
    return deepspeed.__version__


def _local_attention(q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> Tensor:
    """Causal SDPA in DeepSpeed's ``[B, S, H, D]`` layout."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


def _seq_to_heads(x: Tensor, group: dist.ProcessGroup, P: int) -> Tensor:
    """``[B, H, s, D]`` (local tokens, all heads) -> ``[B, H/P, P*s, D]`` (all tokens, our heads)."""
    B, H, s, D = x.shape
    send = x.reshape(B, P, H // P, s, D).permute(1, 0, 2, 3, 4).contiguous()  # [P dest, B, H/P, s, D]
    recv = funcol.all_to_all_single_autograd(send, None, None, group)  # [P src, B, H/P, s, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // P, P * s, D)


def _heads_to_seq(x: Tensor, group: dist.ProcessGroup, P: int) -> Tensor:
    """``[B, H/P, P*s, D]`` -> ``[B, H, s, D]``: the inverse of :func:`_seq_to_heads`."""
    B, h, S, D = x.shape
    send = x.reshape(B, h, P, S // P, D).permute(2, 0, 1, 3, 4).contiguous()  # [P dest, B, H/P, s, D]
    recv = funcol.all_to_all_single_autograd(send, None, None, group)  # [P src (head group), B, H/P, s, D]
    return recv.permute(1, 0, 2, 3, 4).reshape(B, h * P, S // P, D)


class UlyssesAttention(nn.Module):
    """The bundled Llama attention rewritten by hand for Ulysses SP (same parameters)."""

    def __init__(self, attn: Attention, group: dist.ProcessGroup, impl: str = "funcol") -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = attn.wq, attn.wk, attn.wv, attn.wo
        self.n_heads, self.n_kv_heads, self.n_rep, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.n_rep, attn.head_dim
        self.group = group
        self.P = dist.get_world_size(group)
        if self.n_heads % self.P:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by the SP size ({self.P})")
        self.impl = impl
        if impl == "deepspeed":
            from deepspeed.sequence.layer import DistributedAttention

            self.dist_attn = DistributedAttention(_local_attention, group, scatter_idx=2, gather_idx=1)
        elif impl != "funcol":
            raise ValueError(f"impl must be 'deepspeed' or 'funcol', got {impl!r}")

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        if mask is not None:
            raise ValueError("the hand-written Ulysses baseline runs plain causal attention only (no document_ids, no sliding_window)")
        B, s, _ = x.shape  # s = this rank's tokens
        q = self.wq(x).view(B, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)  # cos/sin come from the global positions of the slice
        k = apply_rotary(k, cos, sin)
        k = repeat_kv(k, self.n_rep)
        v = repeat_kv(v, self.n_rep)
        if self.impl == "deepspeed":  # [B, s, H, D] in and out; all-to-alls inside
            out = self.dist_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0)
        else:
            q, k, v = (_seq_to_heads(t, self.group, self.P) for t in (q, k, v))  # [B, H/P, S, D]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out = _heads_to_seq(out, self.group, self.P).transpose(1, 2)  # [B, s, H, D]
        return self.wo(out.reshape(B, s, self.n_heads * self.head_dim))


def ulyssesify(model: Llama, group: dist.ProcessGroup, impl: str = "funcol") -> Llama:
    """Swap every attention module of ``model`` for :class:`UlyssesAttention`, in place."""
    for layer in model.layers:
        layer.attention = UlyssesAttention(layer.attention, group, impl)
    return model


def local_shard(ids: Tensor, labels: Tensor, rank: int, P: int) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's contiguous slice of ``ids``/``labels`` ``[B, S]`` and its global positions."""
    B, S = ids.shape
    if S % P:
        raise ValueError(f"the hand-written baseline needs the sequence length ({S}) divisible by the SP size ({P})")
    s = S // P
    pos = torch.arange(rank * s, (rank + 1) * s).expand(B, s)
    return ids[:, rank * s : (rank + 1) * s], labels[:, rank * s : (rank + 1) * s], pos


def ulysses_loss(model: Llama, ids: Tensor, labels: Tensor, pos: Tensor, sp_size: int) -> Tensor:
    """This rank's share of the mean token loss: summed over local tokens, divided by the
    global count, so that gradients summed over the SP group are the full-sequence ones."""
    logits = model(ids, pos)
    total = labels.numel() * sp_size  # every rank holds the same number of tokens
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1), reduction="sum") / total
