"""A small Llama-style decoder written in plain PyTorch.

The model is deliberately written like an ordinary, unmodified user model so
that a Dynamo-based compiler pass can capture it and rewrite it for sequence
parallelism:

* attention only through ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``
  with ``q``/``k``/``v`` in ``[B, H, S, D]`` layout - or, for packed documents
  (``document_ids``) or a ``sliding_window``, with a boolean mask built from positions, as
  such models build it;
* positions come from ``torch.arange(S)`` of the *input's* sequence length (or
  from an explicit ``position_ids`` argument), and rotary embeddings are built
  on the fly from real ``cos``/``sin`` tensors (no complex numbers);
* grouped-query attention repeats the KV heads before SDPA (Hugging Face
  ``repeat_kv`` style);
* no data-dependent Python control flow, no ``.item()``, no in-place ops on
  activations and no activation checkpointing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LlamaConfig", "Llama", "RMSNorm", "repeat_kv", "rotate_half", "apply_rotary"]


@dataclass
class LlamaConfig:
    """Hyperparameters of :class:`Llama`.

    ``max_seq_len`` is only used for validation and documentation: rotary
    embeddings are computed on the fly from the input's positions, so the model
    has no position-dependent parameters or buffers.
    """

    vocab_size: int
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 256
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    #: attend to at most this many positions (the query's own included); ``None``: every earlier one
    sliding_window: Optional[int] = None

    def __post_init__(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of positions or None, got {self.sliding_window}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def tiny(cls, vocab_size: int = 64, **overrides) -> "LlamaConfig":
        """A very small configuration for unit tests (GQA with 2 query heads per KV head)."""
        kwargs = dict(
            vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
            max_seq_len=256,
        )
        kwargs.update(overrides)
        return cls(**kwargs)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return out.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` along the last dimension."""
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding in rotate-half form; ``x`` is ``[B, H, S, D]``."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Repeat KV heads for grouped-query attention: ``[B, n_kv, S, D] -> [B, n_kv * n_rep, S, D]``.

    Query head ``h`` attends with KV head ``h // n_rep``.
    """
    if n_rep == 1:
        return x
    B, n_kv, S, D = x.shape
    x = x[:, :, None, :, :].expand(B, n_kv, n_rep, S, D)  # [B, n_kv, n_rep, S, D]
    return x.reshape(B, n_kv * n_rep, S, D)  # [B, n_kv * n_rep, S, D]


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.n_rep = config.n_heads // config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim)  # [B, S, H, D]
        k = self.wk(x).view(B, S, self.n_kv_heads, self.head_dim)  # [B, S, H_kv, D]
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim)  # [B, S, H_kv, D]
        q = q.transpose(1, 2)  # [B, H, S, D]
        k = k.transpose(1, 2)  # [B, H_kv, S, D]
        v = v.transpose(1, 2)  # [B, H_kv, S, D]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        k = repeat_kv(k, self.n_rep)  # [B, H, S, D]
        v = repeat_kv(v, self.n_rep)  # [B, H, S, D]
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, S, D]
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, S, D]
        out = out.transpose(1, 2)  # [B, S, H, D]
        out = out.reshape(B, S, self.n_heads * self.head_dim)  # [B, S, H * D]
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama-style causal LM: RMSNorm, SwiGLU, RoPE, GQA and an untied output head.

    ``forward(input_ids [B, S], position_ids [B, S] | None, document_ids [B, S] | None) -> logits [B, S, V]``:
    with ``document_ids`` (packed documents: tokens attend within their own document) or a
    ``config.sliding_window``, attention reads a causal boolean mask built from positions.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 2, dtype=torch.float32), persistent=False)  # [D / 2]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by ``1/sqrt(2 * n_layers)``;
        the RoPE frequency table.

        Uses the global torch RNG: seed it (or use ``torch.random.fork_rng``) for reproducible weights.
        """
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual_out = name.endswith("attention.wo") or name.endswith("feed_forward.w2")
                nn.init.normal_(module.weight, mean=0.0, std=out_std if is_residual_out else std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        head_dim = self.config.head_dim
        with torch.no_grad():  # also rebuilds the table of a model built on the meta device
            self.inv_freq.copy_(1.0 / self.config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def rotary_cos_sin(
        self, seq_len: int, device: torch.device, dtype: torch.dtype, position_ids: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor]:
        """Rotary ``cos``/``sin`` broadcastable against ``[B, H, S, D]``."""
        if position_ids is None:
            pos = torch.arange(seq_len, device=device)  # [S]
            freqs = torch.outer(pos.float(), self.inv_freq)  # [S, D / 2]
            freqs = freqs[None, None, :, :]  # [1, 1, S, D / 2]
        else:
            freqs = position_ids.float()[:, :, None] * self.inv_freq  # [B, S, D / 2]
            freqs = freqs[:, None, :, :]  # [B, 1, S, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B or 1, 1, S, D]
        return torch.cos(emb).to(dtype), torch.sin(emb).to(dtype)

    def attention_mask(self, seq_len: int, device: torch.device, document_ids: Optional[Tensor] = None) -> Optional[Tensor]:
        """``None`` (plain causal), or what each query may attend to: earlier positions, within
        ``sliding_window`` and within its own document (``[B or 1, 1, S, S]``, bool)."""
        window = self.config.sliding_window
        if document_ids is None and window is None:
            return None
        pos = torch.arange(seq_len, device=device)
        keep = pos[:, None] >= pos[None, :]  # [S, S]
        if window is not None:
            keep = keep & (pos[:, None] - pos[None, :] < window)
        keep = keep[None, None]  # [1, 1, S, S]
        if document_ids is not None:
            keep = keep & (document_ids[:, None, :, None] == document_ids[:, None, None, :])  # [B, 1, S, S]
        return keep

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None, document_ids: Optional[Tensor] = None) -> Tensor:
        _, S = input_ids.shape
        h = self.tok_embeddings(input_ids)  # [B, S, dim]
        cos, sin = self.rotary_cos_sin(S, input_ids.device, h.dtype, position_ids)
        mask = self.attention_mask(S, input_ids.device, document_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        h = self.norm(h)
        return self.output(h)  # [B, S, V]
