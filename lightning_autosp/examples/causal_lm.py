"""Demo LightningModule: a causal LM trained on the synthetic KV-recall task.

The module is an ordinary Lightning user module; the sequence-parallel
strategy captures ``self.model`` (and the loss) with Dynamo and rewrites it.
``training_step`` therefore computes the loss from the full logits with a plain
``F.cross_entropy(..., ignore_index=-100)`` call.

Labels from :class:`~lightning_autosp.examples.kv_recall.KVRecallDataModule` are already
aligned with the input positions (no shift), and ``-100`` everywhere except at
query positions, so the token accuracy over non-ignored labels is the *recall
accuracy* (chance is ``1 / num_values``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from lightning import LightningModule
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from lightning_autosp.examples.kv_recall import IGNORE_INDEX, KVRecallDataModule
from autosp.models import build_model

__all__ = ["CausalLMModule", "WarmupCosine"]

# Vocabulary of the default KVRecallDataModule (BOS + keys + values + filler).
_DEFAULT_VOCAB_SIZE = KVRecallDataModule().vocab_size


class CausalLMModule(LightningModule):
    """Causal LM (``"llama"`` or ``"gpt"``) with AdamW and a linear learning-rate warmup.

    Args:
        model: ``"llama"`` (RMSNorm, SwiGLU, RoPE, GQA) or ``"gpt"`` (LayerNorm, GELU,
            learned positions, tied head).
        vocab_size: must match the data (``KVRecallDataModule.vocab_size``).
        dim, n_layers, n_heads: transformer size.
        n_kv_heads: KV heads for grouped-query attention (Llama only; ignored by GPT).
        ffn_hidden: MLP hidden size.
        max_seq_len: GPT position-table size; validation/documentation only for Llama.
        lr, weight_decay, betas: AdamW settings; weight decay applies to matrices only.
        warmup_steps: linear warmup from ``lr / warmup_steps`` to ``lr``.
        cosine_decay: after the warmup, decay the learning rate to 0 along a cosine over the
            rest of the run (``trainer.estimated_stepping_batches``); otherwise keep it constant.
        init_seed: if not ``None``, weights are initialised from this seed in a forked RNG
            so that every process builds identical weights regardless of global RNG state.

    The transformer is built in :meth:`configure_model` (``module.model`` is ``None`` before:
    call ``module.configure_model()`` to use the module outside a ``Trainer``).
    """

    def __init__(
        self,
        model: str = "llama",
        vocab_size: int = _DEFAULT_VOCAB_SIZE,
        dim: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        ffn_hidden: int = 128,
        max_seq_len: int = 2048,
        lr: float = 1e-2,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        cosine_decay: bool = False,
        init_seed: Optional[int] = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[torch.nn.Module] = None  # built in configure_model
        self.train_acc = MulticlassAccuracy(num_classes=vocab_size, ignore_index=IGNORE_INDEX, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=vocab_size, ignore_index=IGNORE_INDEX, average="micro")

    def configure_model(self) -> None:
        """Build the transformer here, Lightning's hook for large models: under
        ``AutoSPStrategy(fsdp=True)`` it is created on the meta device and each rank only ever
        keeps its shard (``init_seed`` then has no effect: the strategy initialises it)."""
        if self.model is not None:  # called again by later stages (validate, test)
            return
        hp = self.hparams
        kwargs: Dict[str, Any] = dict(
            vocab_size=hp.vocab_size, dim=hp.dim, n_layers=hp.n_layers, n_heads=hp.n_heads, ffn_hidden=hp.ffn_hidden,
            max_seq_len=hp.max_seq_len,
        )
        if hp.model.lower() == "llama":
            kwargs["n_kv_heads"] = hp.n_kv_heads
        if hp.init_seed is None:
            self.model = build_model(hp.model, **kwargs)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(hp.init_seed)
                self.model = build_model(hp.model, **kwargs)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids)

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), batch["labels"].view(-1), ignore_index=IGNORE_INDEX)
        self.train_acc(logits.detach().argmax(-1), batch["labels"])
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, prog_bar=True)
        return loss

    def validation_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), batch["labels"].view(-1), ignore_index=IGNORE_INDEX)
        self.val_acc(logits.argmax(-1), batch["labels"])
        # every rank holds the full-sequence loss of its DP group's batch: averaged over the groups
        self.log("val_loss", loss, prog_bar=True, on_step=False, on_epoch=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Dict[str, Any]:
        decay, no_decay = [], []
        for param in self.model.parameters():
            if param.requires_grad:
                (decay if param.ndim >= 2 else no_decay).append(param)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
            betas=tuple(self.hparams.betas),
        )
        total = int(self.trainer.estimated_stepping_batches) if self.hparams.cosine_decay else None
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(self.hparams.warmup_steps, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class WarmupCosine:
    """Picklable LR multiplier: linear warmup ``(step + 1) / warmup_steps`` up to 1, then constant
    (``total_steps=None``) or a cosine decay reaching 0 at ``total_steps``."""

    def __init__(self, warmup_steps: int, total_steps: Optional[int] = None) -> None:
        self.warmup_steps = max(1, int(warmup_steps))
        self.total_steps = total_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
