"""The attention kernel table: which kernel computes each case of attention, on each device.

AutoSP's attention ops (:mod:`.tiled_attention`, :mod:`.ring_attention`) reduce every attention
to calls of one shape: *a block of query rows over a block of keys*, optionally with an additive
bias (the mask of that block, :meth:`~autosp.ops.score_program.ScoreProgram.bias`) or ``is_causal``
(a mask exactly causal for the batch, over the whole sequence), returning the block's output and
per-row log-sum-exp (LSE), from which blocks merge exactly. This module is the one place that
says which kernel runs such a call: :data:`ROWS`, keyed by device and case, and :func:`choose`,
which applies it to the tensors in hand. The cases:

* ``causal`` (a): a whole sequence exactly causal for the batch - one call with ``is_causal``;
* ``block`` (b): rows over keys with no mask (a ring step's block, a live tile whose bias is 0);
* ``bias`` (c): rows over keys with an additive bias (padding, packed documents, windows, ALiBi);
* ``score`` (d): a score function that is not additive (Gemma-2's ``tanh`` soft-capping);
* ``keyless`` (f): a block of rows where a row has no unmasked key under a *finite* fill
  (``finfo.min``, Hugging Face's eager masks): its softmax runs over the fill values of every key.

GQA/MQA (e), the dtype and the head sizes (f) are conditions inside each row; rows with no key
under ``-inf`` (bool masks) are no case of their own: every kernel gives them output 0.
:func:`forward` and :func:`backward` run a chosen kernel with one convention whatever its own:
``out`` ``[B, Hq, Sq, Dv]`` in the queries' dtype, ``lse`` ``[B, Hq, Sq]`` fp32 (natural log),
``-inf`` on rows with no unmasked key (their output 0); backward takes the *final* output and
LSE of the rows (over every key: a ring's merged ones), as the fused kernels' backward ops do.
The ``tiles`` kernel is the interpreted one (:mod:`.tile_kernels`: the score program evaluated in
PyTorch ops, any program): the listed fallback; on CUDA reaching it logs a warning once per case.

Tests without a GPU: ``AUTOSP_KERNEL_ROWS=cuda`` (or :func:`kernel_rows`) makes CPU tensors take
the CUDA rows - the CUDA ops are then called on CPU tensors, which works wherever a CPU
implementation is registered for them (the test suite registers emulations that keep each op's
conventions: ``tests/cuda_emulation.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from autosp.ops.score_program import MASKED

__all__ = [
    "Kernel", "Row", "KERNELS", "ROWS", "CASES", "choose", "count", "forward", "backward", "rows_device", "kernel_rows", "KERNEL_COUNTS",
    "HOST_READS", "to_host", "ROWS_ENV",
]

logger = logging.getLogger(__name__)

aten = torch.ops.aten

CASES = ("causal", "block", "bias", "score", "keyless")
#: the environment variable that makes CPU tensors take another device's rows (``cuda``), for tests
ROWS_ENV = "AUTOSP_KERNEL_ROWS"


@dataclass(frozen=True)
class Kernel:
    """One kernel and its conventions, as the table documents them."""

    name: str
    forward: str
    backward: str
    lse: str
    gqa: str
    bias: str
    limits: str


@dataclass(frozen=True)
class Row:
    """What runs a case on a device: the first kernel whose conditions hold, then the fallback."""

    device: str
    case: str
    kernels: tuple[str, ...]
    why: str


KERNELS = {
    "cpu_flash": Kernel(
        "cpu_flash", "aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention_for_cpu_backward",
        "[B, H, Sq] fp32 (laid out as [B, Sq, H]), natural log", "native (query head i reads KV head i // (Hq/Hk))",
        "a 2-D or 4-D additive attn_mask in the queries' dtype", "values with the queries' head size",
    ),
    "cuda_flash": Kernel(
        "cuda_flash", "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_backward",
        "[B, H, Sq] fp32, natural log", "native", "none (is_causal only; with Sq != Sk it aligns bottom-right, never used so)",
        "fp16/bf16 on compute capability 8.0 or newer; q, k, v of one head size, a multiple of 8, at most 256 (past 192: 8.0 "
        "or 9.0)",
    ),
    "cuda_efficient": Kernel(
        "cuda_efficient", "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_efficient_attention_backward",
        "[B, H, ceil(Sq/32)*32] fp32, natural log, the padded tail unwritten (never read: only [..., :Sq])",
        "none: one call per query head of each KV head (q[:, j::Hq/Hk] against k, v), dK and dV summed",
        "[B, Hq, Sq, Sk] additive in the queries' dtype, last dim contiguous, other strides multiples of 16 bytes "
        "(allocated with the last dim padded to a multiple of 8, then narrowed; broadcast dims expanded, stride 0)",
        "fp16/bf16/fp32 (bf16 on 8.0 or newer); head sizes multiples of 8 (16-bit) or 4 (fp32); values may have another "
        "head size; backward reads out and grad_out as laid out [B, S, H, D] (handed over so); not on ROCm",
    ),
    "tiles": Kernel(
        "tiles", "PyTorch ops per tile (autosp.ops.tile_kernels: the score program interpreted)", "the same, each tile recomputed",
        "m and l apart (max logit and denominator), fp32", "grouped reshape", "any score program", "none",
    ),
}

#: the table (``docs/pass.md`` renders it): per device and case, the kernels in order of preference
ROWS = (
    Row("cpu", "causal", ("cpu_flash", "tiles"), "PyTorch's fused CPU kernel with is_causal over the whole sequence"),
    Row("cpu", "block", ("cpu_flash", "tiles"), "the same kernel without a mask"),
    Row("cpu", "bias", ("cpu_flash", "tiles"), "the same kernel, the block's bias as its attn_mask"),
    Row("cpu", "score", ("tiles",), "no CPU kernel takes a score function (FlexAttention has no CPU backward)"),
    Row("cpu", "keyless", ("tiles",), _KEYLESS := (
        "listed fallback: the log-sum-exp of a row of fill values (about -3.4e38) cannot carry the log of their count "
        "(below its precision), so the blocks are merged with the max and the sum apart; only blocks of rows holding "
        "such a row (left padding under an eager mask), found once per step from the mask")),
    Row("cuda", "causal", ("cuda_flash", "cuda_efficient", "tiles"),
        "flash for 16-bit inputs (fastest, GQA native); the memory-efficient kernel for fp32 and head sizes flash refuses"),
    Row("cuda", "block", ("cuda_flash", "cuda_efficient", "tiles"), "as causal, without is_causal"),
    Row("cuda", "bias", ("cuda_efficient", "tiles"),
        "the one fused PyTorch kernel that takes an additive bias and is safe: flash takes none; cuDNN is silently wrong "
        "with an fp32 bias on bf16 queries (pytorch 191612) and gives NaN in dQ with a mask at S % 128 == 64 on H100 since "
        "2.11 (pytorch 196678)"),
    Row("cuda", "score", ("tiles",),
        "listed fallback: FlexAttention (score_mod) is fused only when compiled on CUDA and has no backward on CPU, so its "
        "conventions cannot be tested without a GPU; soft-capped models (Gemma-2) run the interpreted tiles"),
    Row("cuda", "keyless", ("tiles",), _KEYLESS),
)
_BY_KEY = {(r.device, r.case): r for r in ROWS}

#: calls per (case, kernel) in this process (read by the tests and benchmarks)
KERNEL_COUNTS: dict[tuple[str, str], int] = {}
#: device-to-host reads of data-dependent choices (the masks' maps) in this process: :func:`to_host`
HOST_READS = {"count": 0}
_WARNED: set = set()
_FORCED: list[Optional[str]] = [None]


def rows_device(device: torch.device) -> str:
    """The device whose rows tensors on ``device`` take: its own type, or the one
    :func:`kernel_rows` / ``AUTOSP_KERNEL_ROWS`` forces for CPU tensors (``"cuda"``), or
    ``"tiles"`` on any device (the interpreted tiles everywhere: the baseline the benchmarks time
    the fused kernels against)."""
    forced = _FORCED[0] or os.environ.get(ROWS_ENV)
    if forced == "tiles" or (device.type == "cpu" and forced):
        return forced
    return "cuda" if device.type == "cuda" else "cpu"


@contextlib.contextmanager
def kernel_rows(device: Optional[str]) -> Iterator[None]:
    """CPU tensors take ``device``'s rows inside the block (``"cuda"``; ``None``: their own;
    ``"tiles"``: every tensor the interpreted tiles). Raises if a CUDA op it would call has no CPU
    implementation registered."""
    if device == "cuda":
        missing = [k.forward for k in (KERNELS["cuda_flash"], KERNELS["cuda_efficient"]) if not _has_cpu_kernel(k.forward)]
        if missing:
            raise RuntimeError(
                f"kernel_rows('cuda') makes CPU tensors call {missing}, which have no CPU implementation here: register one "
                "first (the test suite's tests/cuda_emulation.py does)."
            )
    previous = _FORCED[0]
    _FORCED[0] = device
    try:
        yield
    finally:
        _FORCED[0] = previous


def _has_cpu_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.replace("aten.", "aten::"), "CPU")


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on the host, in one transfer (the one read of the device a mask costs per step;
    counted in :data:`HOST_READS` when they are on a device, or take another device's rows)."""
    if not tensors:
        return []
    device = tensors[0].device
    if device.type == "cpu":
        if rows_device(device) != "cpu":
            HOST_READS["count"] += 1
        return list(tensors)
    HOST_READS["count"] += 1
    return unpack_bytes(pack_bytes(tensors).cpu(), tensors)


def pack_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` (any dtypes, shapes and layouts) as one ``uint8`` tensor, one after the other."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def unpack_bytes(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`pack_bytes`' inverse: tensors with the dtypes and shapes of ``like`` (contiguous),
    each copied out of ``flat`` so that its storage starts aligned for its dtype."""
    out, start = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        out.append(flat[start:start + n].clone().view(t.dtype).view(t.shape))
        start += n
    return out


# --------------------------------------------------------------------------- choosing
_HALF = (torch.float16, torch.bfloat16)


def _capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability; for CPU tensors on the CUDA rows (the tests) an
    H100's, the GPU the table is written for."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)


def _fits(kernel: str, q: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why ``kernel`` cannot take these inputs on their device, or ``None`` when it can."""
    d, dv, dtype = q.shape[-1], v.shape[-1], q.dtype
    if kernel == "cpu_flash":
        return None if d == dv else f"values' head size {dv} differs from the queries' {d}"
    if kernel in ("cuda_flash", "cuda_efficient") and torch.version.hip is not None:
        return "ROCm (its fused kernels' conventions differ - an unpadded log-sum-exp - and are not covered)"
    cap = _capability(q.device)
    if kernel == "cuda_flash":
        if dtype not in _HALF:
            return f"{dtype} (flash takes fp16/bf16)"
        if cap < (8, 0):
            return f"compute capability {cap} (flash needs 8.0 or newer)"
        if d != dv or d % 8 or d > 256:
            return f"head sizes {d}/{dv} (flash: one size, a multiple of 8, at most 256)"
        if d > 192 and cap not in ((8, 0), (9, 0)):
            return f"head size {d} on compute capability {cap} (flash's backward past 192 needs 8.0 or 9.0)"
        return None
    if kernel == "cuda_efficient":
        if dtype not in (*_HALF, torch.float32):
            return f"{dtype} (the memory-efficient kernel takes fp16/bf16/fp32)"
        if dtype == torch.bfloat16 and cap < (8, 0):
            return f"bf16 on compute capability {cap} (needs 8.0 or newer)"
        align = 8 if dtype in _HALF else 4
        if d % align or dv % align:
            return f"head sizes {d}/{dv} (the memory-efficient kernel: multiples of {align} in {dtype})"
        return None
    return None


def choose(case: str, q: torch.Tensor, v: torch.Tensor) -> str:
    """The kernel that runs ``case`` for these queries and values: the table's row for their
    device (:func:`rows_device`), its first kernel that takes them. Reaching the ``tiles`` fallback
    on CUDA rows logs a warning once per case and reason."""
    device = rows_device(q.device)
    if device == "tiles":
        return "tiles"
    row = _BY_KEY[(device, case)]
    reasons = []
    for name in row.kernels:
        why = _fits(name, q, v)
        if why is None:
            if name == "tiles" and row.device == "cuda":
                _warn_fallback(case, reasons or [row.why])
            return name
        reasons.append(f"{name}: {why}")
    return "tiles"


def _warn_fallback(case: str, reasons: list[str]) -> None:
    key = (case, tuple(reasons))
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(
            "AutoSP attention on CUDA: the '%s' case runs in the interpreted tiles (PyTorch ops per tile, correct but not "
            "fused): %s. The kernel table: docs/pass.md.", case, "; ".join(reasons),
        )


def count(case: str, kernel: str) -> None:
    """One more call of ``kernel`` for ``case`` in :data:`KERNEL_COUNTS` (forward calls; the tiles: a block of rows)."""
    KERNEL_COUNTS[(case, kernel)] = KERNEL_COUNTS.get((case, kernel), 0) + 1


# --------------------------------------------------------------------------- running
def _aligned_bias(bias: torch.Tensor) -> torch.Tensor:
    """``bias`` (4-D after leading dims of 1) as the memory-efficient kernel takes it: last dim
    contiguous, every other stride a multiple of 16 bytes - the rows padded to a multiple of 8
    columns, then narrowed - to be expanded to ``[B, H, Sq, Sk]`` (stride 0 where it broadcasts)."""
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    sk = bias.shape[-1]
    return F.pad(bias, (0, -(-sk // 8) * 8 - sk)).narrow(-1, 0, sk)


def _rng(q: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The dropout RNG state a fused backward op takes, as its forward returns it (never read:
    dropout is 0): flash's ``[2]`` and ``[]`` uint64, the memory-efficient kernel's two ``[]`` int64."""
    if kernel == "cuda_flash":
        return torch.empty(2, dtype=torch.uint64, device=q.device), torch.empty((), dtype=torch.uint64, device=q.device)
    return torch.zeros((), dtype=torch.int64, device=q.device), torch.zeros((), dtype=torch.int64, device=q.device)


def _efficient_lse(lse: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows of the memory-efficient kernel's LSE (``[B, H, ceil(rows/32)*32]``): its padded
    tail is never written, so never read."""
    return lse.narrow(-1, 0, rows)


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _group(x: torch.Tensor, j: int, kv_heads: int) -> torch.Tensor:
    """Heads ``j, j + r, j + 2r, ...`` of ``x`` ``[B, Hq, ...]`` (``r = Hq / kv_heads``): the query
    heads that read KV heads ``0, 1, ...`` one to one (a view; no indexing, which fake CUDA tensors
    of a CPU build of torch refuse)."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads)).select(2, j)


def _ungroup(parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`_group` over every ``j``: ``parts[j]`` ``[B, Hk, ...]`` back to ``[B, Hq, ...]``."""
    return torch.stack(parts, dim=2).flatten(1, 2)


def _rows_with_keys(bias: torch.Tensor) -> torch.Tensor:
    """Per row of a block, whether its bias leaves any key unmasked (above :data:`MASKED`)."""
    return (bias > MASKED).any(-1)


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, S, D]`` laid out as ``[B, S, H, D]`` (a transposed view of a contiguous
    tensor): the memory-efficient backward reads its ``out`` and ``grad_out`` rows with the stride
    ``H * D`` whatever their strides say (``o_strideM`` is not set from the tensor)."""
    t = x.transpose(1, 2)
    return (t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)).transpose(1, 2)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous (a clone: ``contiguous()`` copies, which fake CUDA tensors of a CPU build refuse)."""
    return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _head_bias(bias: torch.Tensor, j: int, kv_heads: int, heads: int) -> torch.Tensor:
    """The bias (4-D) of query heads :func:`_group` ``j`` (a bias broadcast over heads as it is)."""
    return _group(bias, j, kv_heads) if bias.shape[1] == heads else bias


def forward(
    case: str, kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor], scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of queries ``q`` ``[B, Hq, Sq, D]`` over keys ``k``, ``v`` ``[B, Hk, Sk, D]``
    (``Hq`` a multiple of ``Hk``) in a fused ``kernel``: ``case`` ``"causal"`` (``is_causal``,
    ``Sq == Sk``), ``"block"`` (no mask) or ``"bias"`` (``bias`` broadcastable to
    ``[B, Hq, Sq, Sk]``, in the queries' dtype; rows whose every bias is ``-inf`` get ``lse = -inf``
    and output 0 whatever the kernel made of them). ``out`` in the queries' dtype, ``lse`` fp32."""
    count(case, kernel)
    causal = case == "causal"
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    elif kernel == "cuda_flash":
        out, lse = aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, causal, False, scale=scale)[:2]
    elif kernel == "cuda_efficient":
        B, Hq, Sq, _ = q.shape
        Hk = k.shape[1]
        outs, lses = [], []
        padded = None if bias is None else _aligned_bias(bias)
        for j in range(Hq // Hk):
            bj = None if padded is None else _head_bias(padded, j, Hk, Hq).expand(B, Hk, Sq, k.shape[2])
            o, l = aten._scaled_dot_product_efficient_attention.default(_group(q, j, Hk), k, v, bj, True, 0.0, causal, scale=scale)[:2]
            outs.append(o)
            lses.append(_efficient_lse(l, Sq))
        out, lse = _ungroup(outs), _ungroup(lses)
    else:
        raise ValueError(f"kernel {kernel!r} is not a fused kernel")
    lse = lse.to(_lse_dtype(q))
    if bias is not None:  # rows with no key in this block: nothing, whatever the kernel made of them
        # (under a finite fill too: the memory-efficient kernel scales the logits by log2(e) in fp32,
        # so a fill near finfo.min overflows to -inf and such a row comes back NaN; its fill values
        # weigh nothing against the keys the row has in other blocks, and a row with none anywhere
        # is the keyless case, which runs in the tiles)
        keyed = _rows_with_keys(bias).expand(lse.shape)
        lse = torch.where(keyed, lse, -math.inf)
        out = torch.where(keyed.unsqueeze(-1), out, 0.0)
    return out, lse


def backward(
    case: str, kernel: str, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    bias: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`forward`'s block, given the rows' final ``out`` (queries' dtype)
    and ``lse`` (fp32, over every key the rows read: ``+inf`` for rows with none, whose
    probabilities are then 0), as the fused backward ops take them."""
    causal = case == "causal"
    lse = _dense(lse.to(_lse_dtype(q)))
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    if kernel == "cuda_flash":
        seed, offset = _rng(q, kernel)
        Sq, Sk = q.shape[2], k.shape[2]
        return aten._scaled_dot_product_flash_attention_backward.default(
            grad_out, q, k, v, out, lse, None, None, Sq, Sk, 0.0, causal, seed, offset, scale=scale
        )
    if kernel == "cuda_efficient":
        B, Hq, Sq, _ = q.shape
        Hk = k.shape[1]
        seed, offset = _rng(q, kernel)
        padded = F.pad(lse, (0, -(-Sq // 32) * 32 - Sq))  # the kernel's LSE layout: rows padded to 32
        aligned = None if bias is None else _aligned_bias(bias)
        dqs, dk, dv = [], 0, 0
        for j in range(Hq // Hk):
            bj = None if aligned is None else _head_bias(aligned, j, Hk, Hq).expand(B, Hk, Sq, k.shape[2])
            gq, gk, gv, _ = aten._scaled_dot_product_efficient_attention_backward.default(
                _bshd(_group(grad_out, j, Hk)), _group(q, j, Hk), k, v, bj, _bshd(_group(out, j, Hk)), _dense(_group(padded, j, Hk)),
                seed, offset, 0.0, [True, True, True, False], causal, scale=scale,
            )
            dqs.append(gq)
            dk, dv = dk + gk.float(), dv + gv.float()  # fp32 sums over the groups
        return _ungroup(dqs), dk.to(k.dtype), dv.to(v.dtype)
    raise ValueError(f"kernel {kernel!r} is not a fused kernel")
