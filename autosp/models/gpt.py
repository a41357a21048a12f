"""A small GPT-2-style decoder written in plain PyTorch.

Learned absolute position embeddings (``wpe(torch.arange(S))``), pre-LayerNorm
blocks, a GELU MLP, causal ``F.scaled_dot_product_attention`` fed from a fused
``qkv`` projection, and an output head tied to the token embedding. Like
:mod:`autosp.models.llama` it is written as an ordinary user model so
that a Dynamo-based pass can capture and rewrite it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPTConfig", "GPT"]


@dataclass
class GPTConfig:
    """Hyperparameters of :class:`GPT`. ``max_seq_len`` sizes the position embedding table."""

    vocab_size: int
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 256
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    bias: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def tiny(cls, vocab_size: int = 64, **overrides) -> "GPTConfig":
        """A very small configuration for unit tests."""
        kwargs = dict(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=256)
        kwargs.update(overrides)
        return cls(**kwargs)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.dim = config.dim
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=config.bias)
        self.proj = nn.Linear(config.dim, config.dim, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv(x).split(self.dim, dim=-1)  # 3 x [B, S, dim]
        q = q.view(B, S, self.n_heads, self.head_dim)  # [B, S, H, D]
        k = k.view(B, S, self.n_heads, self.head_dim)  # [B, S, H, D]
        v = v.view(B, S, self.n_heads, self.head_dim)  # [B, S, H, D]
        q = q.transpose(1, 2)  # [B, H, S, D]
        k = k.transpose(1, 2)  # [B, H, S, D]
        v = v.transpose(1, 2)  # [B, H, S, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, S, D]
        out = out.transpose(1, 2)  # [B, S, H, D]
        out = out.reshape(B, S, self.dim)  # [B, S, dim]
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.dim, config.ffn_hidden, bias=config.bias)
        self.proj = nn.Linear(config.ffn_hidden, config.dim, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.dim, eps=config.norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.dim, eps=config.norm_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.attn(self.ln_1(x))
        return h + self.mlp(self.ln_2(h))


class GPT(nn.Module):
    """GPT-2-style causal LM with a tied output head.

    ``forward(input_ids [B, S], position_ids [B, S] | None) -> logits [B, S, V]``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.dim)
        self.wpe = nn.Embedding(config.max_seq_len, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.dim, eps=config.norm_eps, bias=config.bias)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights, zero biases; residual projections scaled by ``1/sqrt(2 * n_layers)``.

        Uses the global torch RNG: seed it (or use ``torch.random.fork_rng``) for reproducible weights.
        """
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if module is self.head:
                continue  # shares its weight with wte
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=out_std if name.endswith(".proj") else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        _, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)  # [S]
        h = self.wte(input_ids) + self.wpe(position_ids)  # [B, S, dim]
        for block in self.blocks:
            h = block(h)
        h = self.ln_f(h)
        return self.head(h)  # [B, S, V]
