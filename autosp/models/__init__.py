"""Bundled causal language models, written as plain PyTorch user models."""

from __future__ import annotations

from typing import Any, Union

from torch import nn

from autosp.models.gpt import GPT, GPTConfig
from autosp.models.llama import Llama, LlamaConfig, RMSNorm, repeat_kv

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "RMSNorm", "repeat_kv", "build_model", "MODEL_NAMES"]

MODEL_NAMES = ("llama", "gpt")


def build_model(name: str, config: Union[LlamaConfig, GPTConfig, None] = None, **kwargs: Any) -> nn.Module:
    """Build a bundled model by name (``"llama"`` or ``"gpt"``) from a config or config keyword arguments.

    Keyword arguments that do not apply to the chosen architecture (``n_kv_heads`` and
    ``rope_theta`` for GPT) are ignored, so one set of CLI arguments drives both models.
    """
    name = name.lower()
    if name == "llama":
        if config is None:
            kwargs.pop("bias", None)
            config = LlamaConfig(**kwargs)
        return Llama(config)
    if name == "gpt":
        if config is None:
            kwargs.pop("n_kv_heads", None)
            kwargs.pop("rope_theta", None)
            config = GPTConfig(**kwargs)
        return GPT(config)
    raise ValueError(f"unknown model {name!r}; expected one of {MODEL_NAMES}")
