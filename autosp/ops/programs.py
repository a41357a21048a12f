"""Score programs of common masks, written directly: what the SP pass extracts from models that
build them (:mod:`autosp.passes.sp_rules.score_program`), for the kernel's tests and benchmarks.

Each returns ``(program, leaves)``: the JSON text :class:`~autosp.ops.score_program.ScoreProgram`
parses and the leaf tensors over every position (``seq`` of them).
"""

from __future__ import annotations

import json
import math
from typing import Optional

import torch

__all__ = ["instruction", "program_text", "causal", "soft_capped_causal", "padded_with_finite_fill"]


def instruction(kind: str, name: str, *args, s: bool = False) -> dict:
    """One instruction: ``kind`` (``"operator"``, ``"torch"``, ``"method"``, ``"special"``) and
    ``name`` called on ``args`` (``{"l": j}``: leaf ``j``, ``{"r": i}``: instruction ``i``'s result,
    ``{"s": 0}``: the scores); ``s``: it depends on the scores."""
    return {"kind": kind, "name": name, "args": list(args), "kwargs": {}, "s": s}


def program_text(instructions: list, leaf_axes: list, dtype: torch.dtype, heads: Optional[tuple] = None) -> str:
    """The program's JSON: its logits are the last instruction's result, in ``dtype``."""
    return json.dumps({
        "instructions": instructions, "out": {"r": len(instructions) - 1}, "leaf_axes": leaf_axes,
        "out_dtype": str(dtype).removeprefix("torch."), "heads": heads,
    })


_ROWS, _COLS = [-2, None], [None, -1]


def causal(
    seq: int, scale: float, dtype: torch.dtype, documents: Optional[torch.Tensor] = None, keys: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
) -> tuple[str, list]:
    """Hugging Face's mask under ``use_cache=False``: ``where(keep, s * scale, -inf)`` with ``keep``
    causal on positions, within one document (``documents``: ``[seq]`` ids), within a sliding
    ``window``, on keys not padded (``keys``: ``[B, seq]`` bools)."""
    pos = torch.arange(seq)
    doc = torch.zeros(seq, dtype=torch.long) if documents is None else documents
    pad = torch.ones(1, seq, dtype=torch.bool) if keys is None else keys
    leaves = [pos[:, None], pos[None, :], doc[:, None], doc[None, :], pad[:, None, None, :]]
    axes = [_ROWS, _COLS, _ROWS, _COLS, _COLS]
    ins = [instruction("operator", "le", {"l": 1}, {"l": 0}), instruction("operator", "eq", {"l": 2}, {"l": 3}),
           instruction("operator", "and_", {"r": 0}, {"r": 1}), instruction("operator", "and_", {"r": 2}, {"l": 4})]
    if window is not None:  # q - k < window
        ins += [instruction("operator", "sub", {"l": 0}, {"l": 1}), instruction("operator", "lt", {"r": 4}, window),
                instruction("operator", "and_", {"r": 3}, {"r": 5})]
    keep = len(ins) - 1
    ins += [instruction("operator", "mul", {"s": 0}, scale, s=True), instruction("torch", "where", {"r": keep}, {"r": keep + 1}, -math.inf, s=True)]
    return program_text(ins, axes, dtype), leaves


def soft_capped_causal(seq: int, scale: float, cap: float, dtype: torch.dtype) -> tuple[str, list]:
    """Gemma-2's logits: ``where(causal, tanh(s * scale / cap) * cap, -inf)`` (not additive)."""
    pos = torch.arange(seq)
    ins = [instruction("operator", "le", {"l": 1}, {"l": 0}), instruction("operator", "mul", {"s": 0}, scale, s=True),
           instruction("operator", "truediv", {"r": 1}, cap, s=True), instruction("torch", "tanh", {"r": 2}, s=True),
           instruction("operator", "mul", {"r": 3}, cap, s=True), instruction("torch", "where", {"r": 0}, {"r": 4}, -math.inf, s=True)]
    return program_text(ins, [_ROWS, _COLS], dtype), [pos[:, None], pos[None, :]]


def padded_with_finite_fill(seq: int, keys: torch.Tensor, scale: float, dtype: torch.dtype) -> tuple[str, list]:
    """An eager Hugging Face mask: ``s * scale + where(causal & key not padded, 0, finfo.min)``
    (``keys``: ``[B, seq]`` bools); left padding leaves rows with no key, whose softmax runs over
    the fill values."""
    pos = torch.arange(seq)
    fmin = torch.finfo(torch.float32).min
    ins = [instruction("operator", "le", {"l": 1}, {"l": 0}), instruction("operator", "and_", {"r": 0}, {"l": 2}),
           instruction("torch", "where", {"r": 1}, 0.0, fmin), instruction("operator", "mul", {"s": 0}, scale, s=True),
           instruction("operator", "add", {"r": 3}, {"r": 2}, s=True)]
    return program_text(ins, [_ROWS, _COLS, _COLS], dtype), [pos[:, None], pos[None, :], keys[:, None, None, :]]
