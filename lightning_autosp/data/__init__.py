"""Synthetic datasets for long-context training demos."""

from lightning_autosp.data.kv_recall import IGNORE_INDEX, KVRecallDataModule, KVRecallDataset

__all__ = ["IGNORE_INDEX", "KVRecallDataModule", "KVRecallDataset"]
