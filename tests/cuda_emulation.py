"""CPU emulations of the CUDA attention ops the kernel table calls, keeping each op's conventions.

Importing this module registers, on the CPU dispatch key (``torch.library``), implementations of
``aten::_scaled_dot_product_flash_attention`` and ``aten::_scaled_dot_product_efficient_attention``
and their backward ops - which have no CPU kernel - so that CPU tensors can take the kernel
table's CUDA rows (``AUTOSP_KERNEL_ROWS=cuda``, :func:`autosp.ops.kernels.kernel_rows`). Each
emulation computes the op's result in fp64 math and refuses what the CUDA op refuses, with the
conventions written down in PyTorch's sources and issues:

* flash: fp16/bf16 only; q, k, v of one head size, a multiple of 8, at most 256; KV heads may
  divide the query heads (native GQA); no bias; ``is_causal`` aligned bottom-right when
  ``Sq != Sk``; LSE ``[B, H, Sq]`` fp32; outputs laid out ``[B, S, H, D]``.
* memory-efficient: fp16/bf16/fp32; as many KV heads as query heads (no GQA); head sizes multiples
  of 8 (16-bit) or 4 (fp32); a bias in the queries' dtype, 4-D ``[B, H, Sq, Sk]`` (broadcast as
  stride 0), last dim contiguous and every other stride a multiple of 16 bytes; ``is_causal``
  aligned top-left; the logits scaled by log2(e) in fp32, so a fill near ``finfo.min`` overflows
  to ``-inf`` (a row of fill values alone is a row with no key); LSE ``[B, H, ceil(Sq/32)*32]``
  fp32 whose padded tail is **NaN** here (``+inf`` on a GPU: reading it is a bug, and NaN makes it
  show); backward takes that padded LSE, and in 16-bit reads ``out`` and ``grad_out`` as laid out
  ``[B, S, H, D]`` whatever their strides (it computes the rows' ``delta`` from them with the row
  stride ``H * D``): other layouts are refused here.
* both: rows whose every key is masked give **NaN** here (a kernel's choice on a GPU: the caller
  must not depend on it); backward reads the ``out`` and ``lse`` it is given (the rows' final
  values over every key, as a ring's merged ones), not a recomputed softmax; the LSE contiguous,
  ``out`` and ``grad_out`` contiguous in their last dim.

:func:`check_flash_args` / :func:`check_efficient_args` are the same conventions as checks, used
on fake CUDA tensors too (``tests/test_kernels.py``' traces at real sizes).
"""

from __future__ import annotations

import math

import torch

HALF = (torch.float16, torch.bfloat16)
FLASH = torch.ops.aten._scaled_dot_product_flash_attention.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention.default
EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default


class ConventionError(RuntimeError):
    """An argument a CUDA attention op would refuse (or silently misread)."""


def _require(ok: bool, why: str) -> None:
    if not ok:
        raise ConventionError(why)


def _check_qkv(q, k, v, last_contiguous=True):
    _require(q.dim() == k.dim() == v.dim() == 4, f"q, k, v must be 4-D, got {q.dim()}, {k.dim()}, {v.dim()}")
    _require(k.shape[:3] == v.shape[:3] and q.shape[0] == k.shape[0], f"k {list(k.shape)}, v {list(v.shape)} do not match q {list(q.shape)}")
    _require(q.dtype == k.dtype == v.dtype, f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if last_contiguous:
        _require(all(x.stride(-1) == 1 for x in (q, k, v)), "q, k, v must be contiguous in their last dim")


def check_flash_args(q, k, v, lse=None):
    _check_qkv(q, k, v)
    _require(q.dtype in HALF, f"FlashAttention only supports fp16 and bf16, got {q.dtype}")
    d = q.shape[-1]
    _require(k.shape[-1] == d and v.shape[-1] == d, f"flash: q, k, v must share one head size, got {d}, {k.shape[-1]}, {v.shape[-1]}")
    _require(d % 8 == 0 and d <= 256, f"flash: head size {d} must be a multiple of 8, at most 256")
    _require(q.shape[1] % k.shape[1] == 0, f"flash: {q.shape[1]} query heads do not group over {k.shape[1]} KV heads")
    if lse is not None:
        _require(lse.dtype == torch.float32 and tuple(lse.shape) == tuple(q.shape[:3]),
                 f"flash: logsumexp must be fp32 {list(q.shape[:3])}, got {lse.dtype} {list(lse.shape)}")


def check_efficient_args(q, k, v, bias, lse=None):
    _check_qkv(q, k, v)
    _require(q.dtype in (*HALF, torch.float32), f"memory-efficient attention takes fp16/bf16/fp32, got {q.dtype}")
    _require(q.shape[1] == k.shape[1], f"memory-efficient attention: {q.shape[1]} query heads and {k.shape[1]} KV heads (no GQA)")
    align = 8 if q.dtype in HALF else 4
    _require(q.shape[-1] % align == 0 and v.shape[-1] % align == 0,
             f"memory-efficient attention: head sizes {q.shape[-1]}/{v.shape[-1]} must be multiples of {align} in {q.dtype}")
    if bias is not None:
        _require(bias.dtype == q.dtype, f"invalid dtype for bias - should match query's dtype ({bias.dtype} bias, {q.dtype} query)")
        want = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        _require(tuple(bias.shape) == want, f"attn_bias must be {list(want)} (broadcast dims expanded), got {list(bias.shape)}")
        _require(bias.stride(-1) == 1, f"attn_bias must be contiguous in its last dim, strides {bias.stride()}")
        step = 16 // bias.element_size()
        _require(all(s % step == 0 for s in bias.stride()[:-1]),
                 f"attn_bias is not correctly aligned: strides {bias.stride()} must be multiples of {step} (16 bytes)")
    if lse is not None:
        want = (q.shape[0], q.shape[1], -(-q.shape[2] // 32) * 32)
        _require(lse.dtype == torch.float32 and tuple(lse.shape) == want,
                 f"memory-efficient attention: logsumexp must be fp32 {list(want)}, got {lse.dtype} {list(lse.shape)}")


def check_efficient_backward_layouts(out, grad_out):
    """In 16-bit the memory-efficient backward computes ``delta = rowsum(dO * O)`` itself, reading
    the rows of ``out`` and ``grad_out`` ``H * D`` apart: they must be laid out ``[B, S, H, D]``."""
    if out.dtype not in HALF:
        return
    for name, x in (("out", out), ("grad_out", grad_out)):
        B, H, S, D = x.shape
        _require(x.stride(-1) == 1 and (H == 1 or x.stride(1) == D) and (S == 1 or x.stride(2) == H * D),
                 f"memory-efficient backward: {name} must be laid out [B, S, H, D] (rows H*D apart), strides {x.stride()}")


def _scores(q, k, scale, bias=None, causal=None, log2_overflow=False):
    """fp64 logits ``[B, Hq, Sq, Sk]`` (KV heads repeated for grouped queries); ``causal``:
    ``"bottom-right"`` (flash: query i sees keys j <= i + Sk - Sq) or ``"top-left"`` (j <= i);
    ``log2_overflow``: logits whose fp32 value times log2(e) overflows are ``-inf`` (the
    memory-efficient kernel's softmax in base 2)."""
    r = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(r, 1)
    s = q.double() @ kk.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if bias is not None:
        s = s + bias.double()
    if log2_overflow:
        s = s.masked_fill((s.float() * math.log2(math.e)).isinf(), -math.inf)
    if causal:
        Sq, Sk = s.shape[-2:]
        keep = torch.ones(Sq, Sk, dtype=torch.bool).tril(Sk - Sq if causal == "bottom-right" else 0)
        s = s.masked_fill(~keep, -math.inf)
    return s


def _forward(q, k, v, scale, bias, causal, log2_overflow=False):
    s = _scores(q, k, scale, bias, causal, log2_overflow)
    lse = torch.logsumexp(s, -1)  # [B, Hq, Sq]; -inf on rows with no key
    p = torch.softmax(s, -1)  # normalised by its sum (an online softmax's m and l apart); NaN on rows with no key
    r = q.shape[1] // k.shape[1]
    out = p @ v.double().repeat_interleave(r, 1)
    laid = torch.empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1]), dtype=q.dtype).transpose(1, 2)  # [B, S, H, D]
    laid.copy_(out)
    return laid, lse


def _backward(grad_out, q, k, v, out, lse, scale, bias, causal, log2_overflow=False):
    """The fused kernels' backward: ``p = exp(s - lse)`` with the LSE given, ``delta = rowsum(dO * O)``
    with the output given."""
    s = _scores(q, k, scale, bias, causal, log2_overflow)
    p = torch.exp(s - lse.double()[..., None])
    r = q.shape[1] // k.shape[1]
    do = grad_out.double()
    vv = v.double().repeat_interleave(r, 1)
    dv = (p.transpose(-1, -2) @ do).unflatten(1, (k.shape[1], r)).sum(2)
    dp = do @ vv.transpose(-1, -2)
    delta = (do * out.double()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    sc = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    dq = ds @ k.double().repeat_interleave(r, 1) * sc
    dk = (ds.transpose(-1, -2) @ q.double() * sc).unflatten(1, (k.shape[1], r)).sum(2)
    return [torch.empty_like(x).copy_(g) for x, g in ((q, dq), (k, dk), (v, dv))] + [ds]


def flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    check_flash_args(query, key, value)
    _require(dropout_p == 0.0, "emulated without dropout")
    out, lse = _forward(query, key, value, scale, None, "bottom-right" if is_causal else None)
    rng, unused = torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)
    return out, lse.float(), None, None, query.shape[2], key.shape[2], rng, unused, torch.empty(0, dtype=query.dtype)


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                   philox_seed, philox_offset, *, scale=None):
    check_flash_args(query, key, value, logsumexp)
    _require(grad_out.shape == out.shape and out.shape[:3] == query.shape[:3], "flash backward: grad_out/out shapes")
    _require(logsumexp.is_contiguous(), "flash backward: logsumexp must be contiguous")
    _require(out.stride(-1) == 1 and grad_out.stride(-1) == 1, "flash backward: out and grad_out contiguous in their last dim")
    return tuple(_backward(grad_out, query, key, value, out, logsumexp, scale, None, "bottom-right" if is_causal else None)[:3])


def efficient_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    check_efficient_args(query, key, value, attn_bias)
    _require(dropout_p == 0.0, "emulated without dropout")
    out, lse = _forward(query, key, value, scale, attn_bias, "top-left" if is_causal else None, log2_overflow=True)
    B, H, Sq = lse.shape
    if compute_log_sumexp:
        padded = torch.full((B, H, -(-Sq // 32) * 32), math.nan, dtype=torch.float32)  # the tail: unwritten on a GPU
        padded[..., :Sq] = lse.float()
    else:
        padded = torch.empty((B, H, 0), dtype=torch.float32)
    return out, padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
                       grad_input_mask, is_causal=False, *, scale=None):
    bias = attn_bias if attn_bias is not None and attn_bias.numel() else None
    check_efficient_args(query, key, value, bias, logsumexp)
    check_efficient_backward_layouts(out, grad_out_)
    dq, dk, dv, ds = _backward(grad_out_, query, key, value, out, logsumexp[..., : query.shape[2]], scale, bias,
                               "top-left" if is_causal else None, log2_overflow=True)
    grad_bias = ds.to(bias.dtype) if bias is not None and grad_input_mask[3] else None
    return dq, dk, dv, grad_bias


_LIB = torch.library.Library("aten", "IMPL")
for _name, _fn in (
    ("_scaled_dot_product_flash_attention", flash_forward),
    ("_scaled_dot_product_flash_attention_backward", flash_backward),
    ("_scaled_dot_product_efficient_attention", efficient_forward),
    ("_scaled_dot_product_efficient_attention_backward", efficient_backward),
):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_name}", "CPU"):  # (a CPU build: none of its own)
        _LIB.impl(_name, _fn, "CPU")
