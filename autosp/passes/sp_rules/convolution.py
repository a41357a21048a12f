"""Short convolutions along the sequence (``conv1d``): each rank convolves its own shard, with
the left context it needs passed from the previous rank (a halo).

Hybrid models mix positions with short causal convolutions next to attention: LFM2's
``ShortConv``, the ``conv1d`` in front of every Mamba-1 and Mamba-2 scan, Qwen3-Next's gated
delta rule. Written as Hugging Face writes them, ``conv1d(x, w, padding=span)[..., :seq_len]`` with
``span = dilation*(k-1)``, output position ``j`` reads the ``span`` positions before ``j`` and
``j`` itself, nothing after it. So the rank owning base positions ``[start, stop)`` computes their
outputs from its shard and the last ``span`` positions of the previous rank's
(:func:`autosp.ops.collectives.seq_pass`: ``span`` positions per row and channel, whatever the
length; zeros on the first rank, which is the padding of one device). The gradient of that
context goes back the same way. No rank ever holds the whole sequence.

The output of a padded convolution is ``span`` positions longer than its input; the extra ones
(outputs past the sequence, which read the right padding) lie on the last rank, which computes
them as one device does, and the ``[..., :seq_len]`` the model applies drops them there
(:func:`autosp.passes.sp_rules.shape.getitem`). A convolution whose output is used otherwise,
with a stride, or with other padding runs replicated, as before.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Optional

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.ops import collectives  # noqa: F401  (registers autosp::seq_pass)
from autosp.passes.placement import Shard, size_expr
from autosp.passes.sp_rules.registry import OpCall, RuleResult, op, sp_rule

if TYPE_CHECKING:
    from autosp.passes.rewrite import SPRewrite

__all__ = ["conv1d"]

SEQ_PASS = torch.ops.autosp.seq_pass.default

_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def _arguments(node: fx.Node) -> dict[str, Any]:
    args = dict(_DEFAULTS)
    args.update(zip(_NAMES, node.args))
    args.update(node.kwargs)
    return args


def _single(value: Any) -> Optional[int]:
    """An int from ``3`` or ``(3,)``; ``None`` for anything else (``"same"``, a SymInt)."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if value == "valid":
        return 0
    return value if isinstance(value, int) else None


def length_cut(rw: "SPRewrite", user: fx.Node, conv: fx.Node, ndim: int) -> Optional[int]:
    """``k`` if ``user`` is ``conv_out[..., :length - k]`` (any spelling of the leading
    dims), the length being the axis' whole size, else ``None``."""
    if user.target is not operator.getitem or user.args[0] is not conv:
        return None
    idx = user.args[1]
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if items and items[0] is Ellipsis:
        items = [slice(None)] * (ndim - len(items) + 1) + items[1:]
    if len(items) != ndim or any(i != slice(None) for i in items[:-1]):
        return None
    last = items[-1]
    if not isinstance(last, slice) or last.start not in (None, 0) or last.step not in (None, 1):
        return None
    stop = rw.val(last.stop) if isinstance(last.stop, fx.Node) else last.stop
    if not isinstance(stop, (int, torch.SymInt)):
        return None
    cut = sympy.expand(rw.shape(conv)[-1] - size_expr(stop))
    return int(cut) if cut.is_Integer else None


@sp_rule(op("conv1d", torch.conv1d, method=False))  # F.conv1d is torch.conv1d
def conv1d(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """A causal ``conv1d`` over a sequence-sharded length axis (stride 1, padding ``span``, the
    output cut back to the sequence), on the rank's shard with a halo from the previous rank (see
    the module docstring)."""
    a = _arguments(node)
    x, weight, bias = a["input"], a["weight"], a["bias"]
    shard = rw.placements.get(x)
    ndim = rw.val(x).dim()
    if not isinstance(shard, Shard) or any(rw.is_shard(n) for n in (weight, bias) if isinstance(n, fx.Node)):
        return None
    if shard.dim != ndim - 1 or shard.inner != 1 or shard.off != 0 or sympy.expand(shard.length - rw.seq) != 0:
        return None  # the length axis must be the whole, unshifted sequence
    stride, padding, dilation, groups = (_single(a[k]) for k in ("stride", "padding", "dilation", "groups"))
    kernel = rw.val(weight).shape[-1]
    if stride != 1 or dilation is None or groups is None or not isinstance(kernel, int):
        return None
    span = dilation * (kernel - 1)
    if not span or padding != span or any(length_cut(rw, user, node, ndim) != span for user in node.users):
        return None  # a pointwise convolution (no rule yet), or not causal, or the outputs past the sequence kept
    g, xl = rw.graph, rw.new_value[x]
    tail = g.call_function(operator.getitem, (xl, (Ellipsis, slice(-span, None))))
    halo = g.call_function(SEQ_PASS, (tail, True, rw.group_name, rw.sp_size, rw.sp_rank))
    wide = g.call_function(torch.cat, ([halo, xl], -1))  # [.., span + local]: the first rank's halo is the left padding
    rw.stats.max_shift = max(rw.stats.max_shift, span)  # every shard must be longer than its halo
    if rw.sp_rank == rw.sp_size - 1:  # the right padding: the outputs past the sequence, dropped by the cut
        wide = g.call_function(F.pad, (wide, (0, span)))
    out = rw.copy(node, (wide, rw.new_value[weight], rw.new(bias), 1, 0, dilation, groups), {})
    rw.stats.halo_convolutions += 1
    return out, Shard(ndim - 1, sympy.expand(shard.length + span))
