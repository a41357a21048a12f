"""The vocabulary projection and cross-entropy in chunks of tokens: the logits never exist whole.

At long sequences the logits dominate activation memory: a Llama-3 vocabulary (128,256) over
16k tokens per rank is 3.9 GiB in bf16, twice that for the fp32 upcast and again for its
gradient. ``linear_cross_entropy`` computes ``cross_entropy(linear(h, W, b).to(dtype), target,
reduction="sum")`` over ``chunk`` rows of ``h`` at a time and, while a chunk's logits are live,
also the gradient of that chunk's loss with respect to ``h``, ``W`` and ``b``. The loss is a
scalar, so its gradient is ``grad_output`` times those: backward only scales them. Nothing of
size ``tokens x vocab`` outlives one chunk, and the step does the same matmuls as autograd
would (one for the logits, two for their gradient), so no logits are recomputed.

The SP pass emits it where the graph computes ``cross_entropy`` of a ``linear`` whose logits
have no other use (see :mod:`autosp.passes.sp_rules.reduction`).

The op lives in its own namespace (``autosp_loss``), not ``autosp``: the memory report and SAC
count every ``autosp::`` op as a collective.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["linear_cross_entropy", "auto_chunk_rows", "workspace_bytes", "LOGITS_CHUNK_BYTES"]

#: the fp32 logits of one chunk, in bytes, when the chunk is chosen automatically
LOGITS_CHUNK_BYTES = 256 * 2**20


def auto_chunk_rows(vocab: int) -> int:
    """Rows per chunk so that one chunk's fp32 logits take about :data:`LOGITS_CHUNK_BYTES`
    (512 rows for a 128k vocabulary, 2048 for 32k)."""
    return max(64, LOGITS_CHUNK_BYTES // (4 * max(int(vocab), 1)))


def workspace_bytes(
    rows: int, vocab: int, dim: int, dtype: torch.dtype, logits_dtype: Optional[torch.dtype], chunk: int, plain: bool = True
) -> int:
    """Bytes :func:`linear_cross_entropy` allocates while it runs, beyond its inputs and outputs
    (what the memory model adds at the op), plus the fp32 accumulator of the weight gradient when
    the weight is in a low-precision dtype. ``plain`` (no class weights, no label smoothing): one
    chunk's logits (in ``dtype``) and, when ``logits_dtype`` differs, their cast, in which the
    gradient is computed in place, and the gradient cast back; otherwise also the log-softmax,
    the softmax and the scaled gradient."""
    item = torch.empty((), dtype=dtype).element_size()
    out_dtype = logits_dtype or dtype
    out_item = torch.empty((), dtype=out_dtype).element_size()
    if plain:
        per_row = vocab * (item if out_dtype == dtype else 2 * item + out_item)
    else:
        per_row = vocab * (2 * item + 3 * out_item)
    acc = 4 * vocab * dim if dtype not in (torch.float32, torch.float64) else 0
    return min(rows, chunk) * per_row + acc


def _logits_grad(
    logits: torch.Tensor, target: torch.Tensor, class_weight: Optional[torch.Tensor], ignore_index: int, smoothing: float
) -> torch.Tensor:
    """d/d logits of ``cross_entropy(logits, target, class_weight, ignore_index, "sum", smoothing)``
    (class weights and smoothing are not combined: the pass keeps that case unfused)."""
    grad = torch.softmax(logits, dim=-1)
    valid = target != ignore_index
    safe = target.masked_fill(~valid, 0).unsqueeze(1)
    if smoothing:
        grad = grad - smoothing / logits.shape[-1]
    grad.scatter_add_(1, safe, torch.full_like(safe, -(1.0 - smoothing), dtype=grad.dtype))
    scale = valid.to(grad.dtype)
    if class_weight is not None:
        scale = scale * class_weight.to(grad.dtype)[safe.squeeze(1)]
    return grad * scale.unsqueeze(1)


def _plain_loss_and_grad(
    z: torch.Tensor, target: torch.Tensor, ignore_index: int, with_grad: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``cross_entropy(z, target, ignore_index=ignore_index, reduction="sum")`` and, with
    ``with_grad``, its gradient with respect to ``z``, computed in ``z``'s own memory (the
    caller's fresh logits, nothing else reads them): one log-sum-exp per row, then
    ``exp(z - lse)`` in place is the softmax, minus 1 at the target. Rows whose target is
    ``ignore_index`` get ``lse = inf``, so their gradient is 0 without a separate masking pass."""
    valid = target != ignore_index
    safe = target.masked_fill(~valid, 0).unsqueeze(1)
    lse = torch.logsumexp(z, dim=1)
    picked = z.gather(1, safe).squeeze(1)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    if not with_grad:
        return loss, None
    lse.masked_fill_(~valid, float("inf"))
    grad = z.sub_(lse.unsqueeze(1)).exp_()
    grad.scatter_add_(1, safe, valid.to(grad.dtype).neg_().unsqueeze(1))
    return loss, grad


@torch.library.custom_op("autosp_loss::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    class_weight: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    logits_dtype: Optional[torch.dtype],
    chunk: int,
    with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, d loss/d h, d loss/d weight, d loss/d bias)``: the summed cross-entropy of the
    rows of ``h`` ``[N, D]`` projected by ``weight`` ``[V, D]`` (and ``bias``), cast to
    ``logits_dtype``, against ``target`` ``[N]``. Without ``with_grad`` (graphs that need no
    backward) the gradients are empty; without ``bias`` its gradient is. Dtypes are explicit
    (the pass casts as autocast would), so autocast is off inside."""
    with torch.autocast(h.device.type, enabled=False):
        return _linear_cross_entropy(h, weight, bias, target, class_weight, ignore_index, label_smoothing, logits_dtype, chunk, with_grad)


def _linear_cross_entropy(h, weight, bias, target, class_weight, ignore_index, label_smoothing, logits_dtype, chunk, with_grad):
    out_dtype = logits_dtype or torch.promote_types(h.dtype, weight.dtype)
    total = torch.zeros((), dtype=out_dtype, device=h.device)
    low_precision = weight.dtype not in (torch.float32, torch.float64)
    grad_h = torch.empty_like(h) if with_grad else h.new_empty(0)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32 if low_precision else weight.dtype, device=weight.device)
    grad_b = torch.zeros(bias.shape, dtype=grad_w.dtype, device=h.device) if bias is not None and with_grad else h.new_empty(0)
    for start in range(0, h.shape[0], chunk):
        h_c, t_c = h[start : start + chunk], target[start : start + chunk]
        logits = F.linear(h_c, weight, bias)
        z = logits.to(out_dtype)
        if class_weight is None and not label_smoothing:
            loss, g = _plain_loss_and_grad(z, t_c, ignore_index, with_grad)
            total += loss
        else:
            total += F.cross_entropy(
                z, t_c, weight=class_weight, ignore_index=ignore_index, reduction="sum", label_smoothing=label_smoothing
            )
            g = _logits_grad(z, t_c, class_weight, ignore_index, label_smoothing) if with_grad else None
        if not with_grad:
            continue
        g = g.to(logits.dtype)
        torch.mm(g, weight, out=grad_h[start : start + chunk])
        if low_precision:
            grad_w += (g.t() @ h_c).float()
        else:
            grad_w.addmm_(g.t(), h_c)
        if bias is not None:
            grad_b += g.sum(0, dtype=grad_b.dtype)
    if not with_grad:
        return total, grad_h, weight.new_empty(0), grad_b
    return total, grad_h, grad_w.to(weight.dtype), grad_b.to(bias.dtype) if bias is not None else grad_b


@linear_cross_entropy.register_fake
def _(h, weight, bias, target, class_weight, ignore_index, label_smoothing, logits_dtype, chunk, with_grad):
    out_dtype = logits_dtype or torch.promote_types(h.dtype, weight.dtype)
    total = h.new_empty((), dtype=out_dtype)
    if not with_grad:
        return total, h.new_empty(0), weight.new_empty(0), h.new_empty(0)
    grad_b = torch.empty_like(bias) if bias is not None else h.new_empty(0)
    return total, torch.empty_like(h), torch.empty_like(weight), grad_b


def _setup_context(ctx, inputs, output) -> None:
    _, grad_h, grad_w, grad_b = output
    ctx.has_bias = inputs[2] is not None
    ctx.with_grad = inputs[9]
    ctx.save_for_backward(grad_h, grad_w, grad_b)


def _backward(ctx, grad_total, *_unused):
    if not ctx.with_grad:
        raise RuntimeError(
            "internal: autosp_loss::linear_cross_entropy was compiled for a graph without backward (no_grad) "
            "but is being differentiated. Report this; AutoSPStrategy(chunked_loss=False) is a workaround."
        )
    grad_h, grad_w, grad_b = ctx.saved_tensors
    scale = grad_total.to(grad_h.dtype)
    return (
        grad_h * scale,
        grad_w * scale.to(grad_w.dtype),
        grad_b * scale.to(grad_b.dtype) if ctx.has_bias else None,
        None, None, None, None, None, None, None,
    )


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
