"""Sequence mixers other than attention - scans, gated delta rules, linear recurrences - placed the
way Ulysses places attention: all-to-all from the rank's positions with every head to every
position with the rank's heads, the mixer on those, and all-to-all back.

A sequence mixer is a function whose output at one position reads other positions: Mamba-2's
chunked scan (SSD), the gated delta rule of Qwen3-Next and Qwen3.5, Mamba-1's selective scan. Each
is separable over heads (or channels): head ``h`` of the output reads head ``h`` of the inputs
only, so a rank that holds every position of ``H/P`` heads computes their output exactly as one
device does. Inputs shared by a group of heads (Mamba-2's ``B``/``C`` groups, Qwen3-Next's key
heads) split over the group like the key/value heads of attention when their count divides by
``P``, and are gathered whole when there is one; per-head parameters (``A``, ``D``, ``dt_bias``)
are narrowed to the rank's heads, so their gradients are this rank's share of the one-device
gradient (the synchronisation over the SP group adds the shares).

The function runs as one node of the graph: :func:`register_mixer` asks Dynamo to keep it whole
(:func:`torch.compiler.allow_in_graph`; AOTAutograd still traces through it, so it compiles and
differentiates as before) and registers the rule below for it. Hugging Face names these functions
(the entry points its ``kernels`` integration can swap for ``mamba_ssm``'s or
``flash-linear-attention``'s on a GPU); :func:`register_hf_mixers` registers the ones a model's
modeling module defines. A mixer of one's own takes one call::

    register_mixer(my_scan, inputs={"x": Heads(seq=1, head=2), "decay": Heads(seq=1, head=2),
                                    "A": PerHead(0)}, outputs=Heads(seq=1, head=2))

A call the rule cannot place - a recurrent state passed in or asked for, packed-document indices,
a head count the SP group does not divide, a tensor argument the spec does not describe - is
refused before training with the op and the user's source line; it never runs replicated.
"""

from __future__ import annotations

import inspect
import logging
import operator
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Union

import torch
import torch.fx as fx

from autosp.errors import AutoSPError, user_source
from autosp.ops.collectives import heads_order, pack_heads  # noqa: F401  (registers autosp::pack_heads)
from autosp.passes import runtime
from autosp.passes.placement import Shard, is_tensor, norm_dim
from autosp.passes.sp_rules.registry import OpCall, RuleResult, op, sp_rule

if TYPE_CHECKING:
    from autosp.passes.rewrite import SPRewrite

__all__ = ["Heads", "PerHead", "Whole", "MixerSpec", "register_mixer", "register_hf_mixers", "mixer_spec", "HF_MIXERS"]

log = logging.getLogger(__name__)

PACK_HEADS = torch.ops.autosp.pack_heads.default


@dataclass(frozen=True)
class Heads:
    """An argument (or output) holding the sequence in dim ``seq`` and heads, groups or channels
    in dim ``head``: exchanged to the rank's heads over the whole sequence (gathered whole when it
    has one head, shared by all)."""

    seq: int
    head: int


@dataclass(frozen=True)
class PerHead:
    """An argument without a sequence axis holding one value per head (or group, or channel) in
    dim ``dim``: narrowed to the rank's block."""

    dim: int = 0


@dataclass(frozen=True)
class Whole:
    """An argument holding the sequence in dim ``seq`` that every head reads (Mamba-1's ``B`` and
    ``C``): gathered whole on every rank."""

    seq: int


Placement = Union[Heads, PerHead, Whole]


@dataclass
class MixerSpec:
    """How to place one mixer: ``inputs`` by parameter name, ``outputs`` (one :class:`Heads`, or a
    tuple with ``None`` where the function returns ``None``), ``require``: parameters that must
    have the given value (a recurrent state in or out, document indices), with the reason."""

    fn: Callable
    name: str
    inputs: Mapping[str, Placement]
    outputs: Union[Heads, tuple[Optional[Heads], ...]]
    require: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    signature: Optional[inspect.Signature] = None


_SPECS: dict[Callable, MixerSpec] = {}


def mixer_spec(fn: Any) -> Optional[MixerSpec]:
    """The spec ``fn`` was registered with, ``None`` if it was not."""
    try:
        return _SPECS.get(fn)
    except TypeError:  # an unhashable target
        return None


def register_mixer(
    fn: Callable,
    *,
    inputs: Mapping[str, Placement],
    outputs: Union[Heads, tuple[Optional[Heads], ...]],
    require: Optional[Mapping[str, Any]] = None,
    name: Optional[str] = None,
) -> Callable:
    """Make ``fn`` a sequence mixer AutoSP places over heads (see the module docstring); returns
    ``fn``. ``require`` maps a parameter to the only value AutoSP accepts for it (e.g.
    ``{"initial_state": None}``), or to ``(value, why)``. Registering a function again replaces its
    spec."""
    if not callable(fn):
        raise TypeError(f"register_mixer(fn=...): expected a function, got {type(fn).__name__}")
    for arg, placement in inputs.items():
        if not isinstance(placement, (Heads, PerHead, Whole)):
            raise TypeError(f"register_mixer(inputs={{{arg!r}: ...}}): expected Heads, PerHead or Whole, got {placement!r}")
    for out in outputs if isinstance(outputs, tuple) else (outputs,):
        if out is not None and not isinstance(out, Heads):
            raise TypeError(f"register_mixer(outputs=...): expected Heads or a tuple of Heads and None, got {out!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        unknown = [a for a in (*inputs, *(require or {})) if a not in signature.parameters]
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            raise TypeError(f"register_mixer(inputs=...): {getattr(fn, '__name__', fn)} has no parameter(s) {unknown}")
    required = {k: (v if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], str) else (v, "")) for k, v in (require or {}).items()}
    spec = MixerSpec(fn, name or getattr(fn, "__name__", repr(fn)), dict(inputs), outputs, required, signature)
    if fn not in _SPECS:
        sp_rule(op(spec.name, fn, method=False), source=True)(_mixer_rule)
        torch.compiler.allow_in_graph(fn)
    _SPECS[fn] = spec
    return fn


# --------------------------------------------------------------------------- Hugging Face's mixers

_NO_STATE = "AutoSP trains from a zero state over the whole sequence; a recurrent state in or out has no place in a training step"
_NO_DOCS = "packed documents in a sequence mixer are not supported yet (on CPU Hugging Face refuses them on one device too)"

#: the functions Hugging Face's modeling modules call for their mixers, by the name they define them
#: under, with their placements
HF_MIXERS: dict[str, dict[str, Any]] = {
    # Mamba-2 (Mamba2, Bamba, Falcon-H1, Nemotron-H, Granite 4 hybrids): x [B, S, H, P], dt [B, S, H],
    # B and C [B, S, G, N], A, D and dt_bias per head
    "mamba2_chunk_scan": dict(
        inputs={
            "hidden_states": Heads(1, 2), "dt": Heads(1, 2), "B": Heads(1, 2), "C": Heads(1, 2), "z": Heads(1, 2),
            "A": PerHead(0), "D": PerHead(0), "dt_bias": PerHead(0),
        },
        outputs=Heads(1, 2),
        require={
            "initial_states": (None, _NO_STATE), "return_final_states": (False, _NO_STATE),
            "seq_idx": (None, _NO_DOCS), "cu_seqlens": (None, _NO_DOCS),
        },
    ),
    # gated delta rules (Qwen3-Next, Qwen3.5): q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g and beta [B, S, Hv]
    "torch_chunk_gated_delta_rule": dict(
        inputs={"query": Heads(1, 2), "key": Heads(1, 2), "value": Heads(1, 2), "g": Heads(1, 2), "beta": Heads(1, 2)},
        outputs=(Heads(1, 2), None),
        require={"initial_state": (None, _NO_STATE), "output_final_state": (False, _NO_STATE), "cu_seqlens": (None, _NO_DOCS)},
    ),
    # Kimi's delta attention (Kimi Linear): as the gated delta rule, g per channel [B, S, H, Dk]
    "chunk_kimi_delta_attention": dict(
        inputs={"query": Heads(1, 2), "key": Heads(1, 2), "value": Heads(1, 2), "g": Heads(1, 2), "beta": Heads(1, 2)},
        outputs=(Heads(1, 2), None),
        require={"initial_state": (None, _NO_STATE), "output_final_state": (False, _NO_STATE), "cu_seqlens": (None, _NO_DOCS)},
    ),
    # Mamba-1's selective scan (Mamba, Jamba, Falcon-Mamba): x, dt and z [B, D, L] (channels), B and C
    # [B, N, L] read by every channel, A [D, N], D and delta_bias per channel
    "mamba_selective_scan": dict(
        inputs={
            "hidden_states": Heads(2, 1), "dt": Heads(2, 1), "z": Heads(2, 1), "B": Whole(2), "C": Whole(2),
            "A": PerHead(0), "D": PerHead(0), "delta_bias": PerHead(0),
        },
        outputs=Heads(2, 1),
        require={"return_last_state": (False, _NO_STATE)},
    ),
}


def _plain_function(obj: Any) -> Optional[Callable]:
    """The function a Hugging Face entry point calls: the entry point itself, or - where the
    ``kernels`` package wraps it in a module that dispatches to a swapped-in kernel - the function
    that module calls by default."""
    if inspect.isfunction(obj):
        return obj
    forward = getattr(type(obj), "forward", None)
    if isinstance(obj, torch.nn.Module) and inspect.isfunction(forward):
        try:
            inner = inspect.getclosurevars(forward).nonlocals.get("func")
        except (TypeError, ValueError):
            return None
        return inner if inspect.isfunction(inner) else None
    return None


def register_hf_mixers(module: torch.nn.Module) -> list[str]:
    """Register the Hugging Face mixers (:data:`HF_MIXERS`) of the modeling modules ``module``'s
    sub-modules come from; returns ``module.function`` for each registered."""
    names = {type(m).__module__ for m in module.modules()}
    done = []
    for modname in sorted(n for n in names if n.startswith("transformers.")):
        mod = sys.modules.get(modname)
        for attr, kwargs in HF_MIXERS.items():
            entry = getattr(mod, attr, None)
            if entry is None:
                continue
            fn = _plain_function(entry)
            if fn is None:
                log.warning(
                    "AutoSP: %s.%s is a %s it cannot see into; its mixer is traced as it is and ops it cannot place are "
                    "reported (strict=True refuses them).", modname, attr, type(entry).__name__,
                )
                continue
            if mixer_spec(fn) is None:
                register_mixer(fn, name=f"{modname.rsplit('.', 1)[-1]}.{attr}", **kwargs)
            done.append(f"{modname}.{attr}")
    return done


# --------------------------------------------------------------------------- the rule


def _refuse(rw: "SPRewrite", node: fx.Node, spec: MixerSpec, why: str) -> AutoSPError:
    return AutoSPError(
        f"{node.name}: AutoSP cannot place the sequence mixer {spec.name}: {why}.\n" + user_source(node)
    )


def _bound(node: fx.Node, spec: MixerSpec) -> dict[str, Any]:
    if spec.signature is None:
        return dict(node.kwargs)
    bound = spec.signature.bind_partial(*node.args, **node.kwargs)
    bound.apply_defaults()
    args = dict(bound.arguments)
    for p in spec.signature.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            args.update(args.pop(p.name, {}))
        elif p.kind is p.VAR_POSITIONAL and args.pop(p.name, ()):
            raise AutoSPError(f"{node.name}: {spec.name} is called with extra positional arguments AutoSP cannot name")
    return args


def _block(rw: "SPRewrite", node: fx.Node, spec: MixerSpec, what: str, count: Any) -> Optional[tuple[int, int]]:
    """``(first, per_rank)`` of the rank's block of ``count`` heads (groups, channels), ``None`` when
    one is shared by all."""
    if not isinstance(count, int):
        raise _refuse(rw, node, spec, f"{what} has a symbolic number of heads ({count})")
    if count == 1:
        return None
    if count % rw.sp_size:
        raise _refuse(
            rw, node, spec,
            f"{what} has {count} heads (or groups, or channels), not divisible by sp_size={rw.sp_size}; the mixer's heads "
            f"split over the SP group as attention's do. Use an sp_size that divides {count}",
        )
    per_rank = count // rw.sp_size
    return rw.sp_rank * per_rank, per_rank


def _mixer_rule(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    from autosp.passes.attention_schemes import get_scheme

    spec = _SPECS.get(node.target)
    if spec is None:  # its placement taken away: it runs replicated, reported
        return None
    ulysses = get_scheme("ulysses")
    args = _bound(node, spec)
    for name, (value, why) in spec.require.items():
        got = args.get(name, value)
        if isinstance(got, fx.Node) or not (got is value or got == value):
            shown = "a tensor" if isinstance(got, fx.Node) else repr(got)
            raise _refuse(rw, node, spec, f"{name}={shown}; AutoSP accepts only {name}={value!r}" + (f" ({why})" if why else ""))
    g = rw.graph
    exchanges = 0
    new_args: dict[str, Any] = {}
    for name, a in args.items():
        if not isinstance(a, fx.Node) or not is_tensor(rw.val(a)):
            if isinstance(a, (tuple, list)) and any(isinstance(x, fx.Node) for x in a):
                raise _refuse(rw, node, spec, f"{name} is a sequence of tensors")
            new_args[name] = rw.new(a)
            continue
        placement = spec.inputs.get(name)
        shape = rw.val(a).shape
        if placement is None:
            raise _refuse(rw, node, spec, f"its tensor argument {name} {list(shape)} has no placement in the mixer's spec (register_mixer(inputs=...))")
        if isinstance(placement, PerHead):
            if rw.is_shard(a):
                raise _refuse(rw, node, spec, f"{name} {list(shape)} holds the sequence; PerHead({placement.dim}) says it does not")
            dim = norm_dim(placement.dim, len(shape))
            block = _block(rw, node, spec, name, shape[dim])
            value = rw.new(a)
            new_args[name] = value if block is None else g.call_function(torch.narrow, (value, dim, *block))
            continue
        seq = norm_dim(placement.seq, len(shape))
        _check_sequence(rw, node, spec, name, a, seq)
        head = None if isinstance(placement, Whole) else norm_dim(placement.head, len(shape))
        if head is None or _block(rw, node, spec, name, shape[head]) is None:  # every head reads it: whole on every rank
            new_args[name] = rw.redistribute.to_replicate(a)
            continue
        local = rw.new_value[a] if rw.is_shard(a) else rw.redistribute.to_shard(a, rw.base_shard(seq))
        new_args[name] = _to_heads(rw, ulysses, local, int(shape[head]), head, seq, shape)
        exchanges += 1
    out = g.call_function(node.target, (), new_args)
    val = rw.val(node)
    outs = spec.outputs if isinstance(spec.outputs, tuple) else (spec.outputs,)
    vals = val if isinstance(spec.outputs, tuple) else (val,)
    if not isinstance(vals, (tuple, list)) or len(vals) != len(outs):
        raise _refuse(rw, node, spec, f"it returned {type(val).__name__} where its spec describes {len(outs)} output(s)")
    results, placements = [], []
    for i, (o, v) in enumerate(zip(outs, vals)):
        item = g.call_function(operator.getitem, (out, i)) if isinstance(spec.outputs, tuple) else out
        if o is None:
            if v is not None:
                raise _refuse(rw, node, spec, f"its output {i} is a tensor its spec does not place")
            results.append(None)
            placements.append(None)
            continue
        seq, head = norm_dim(o.seq, v.dim()), norm_dim(o.head, v.dim())
        if _block(rw, node, spec, f"its output {i}", v.shape[head]) is None:
            raise _refuse(rw, node, spec, f"its output {i} {list(v.shape)} has one head in dim {head}: there are no heads to split")
        results.append(_to_sequence(rw, ulysses, item, head, seq, v.shape))
        placements.append(rw.base_shard(seq))
        exchanges += 1
    rw.stats.sequence_mixers += 1
    rw.stats.mixer_all_to_alls += exchanges
    if isinstance(spec.outputs, tuple):
        return g.call_function(runtime.pack, tuple(results)), tuple(placements)
    return results[0], placements[0]


def _check_sequence(rw: "SPRewrite", node: fx.Node, spec: MixerSpec, name: str, a: fx.Node, seq: int) -> None:
    """``a`` holds the whole sequence in dim ``seq``: sharded there as an unsliced activation, or
    replicated with that dim as long as the sequence."""
    shape = rw.shape(a)
    shard = rw.placements.get(a)
    if isinstance(shard, Shard):
        if shard.dim != seq or shard.inner != 1 or shard.off != 0 or (shard.length - rw.seq).expand() != 0:
            raise _refuse(rw, node, spec, f"{name} {list(shape)} reaches it sharded as {shard}, not as the whole sequence in dim {seq}")
    elif seq not in rw.seq_dims(a):
        raise _refuse(rw, node, spec, f"{name} {list(shape)} has no sequence of {rw.seq} positions in dim {seq}")


def _to_heads(rw: "SPRewrite", ulysses: Any, x: fx.Node, heads: int, head: int, seq: int, shape: Any) -> fx.Node:
    """``x`` (the rank's positions, every head) as every position of the rank's heads, laid out as
    ``x`` is: the send buffer is :func:`~autosp.ops.collectives.pack_heads` (whose gradient is laid
    out as ``x``, as one device lays it out), the exchange the scheme's."""
    g = rw.graph
    order = heads_order(head, seq, len(shape))
    lead = order.index(head)
    send = g.call_function(PACK_HEADS, (x, head, seq, rw.sp_size))  # [P, lead.., S_r, h/P, D]
    full = ulysses._gather(rw, send, lead)  # [lead.., S, h/P, D]
    rw.stats.all_to_all += 1
    trail = [int(shape[d]) for d in order[lead + 2 :]]
    y = g.call_function(torch.unflatten, (full, -1, trail)) if trail else g.call_function(torch.squeeze, (full, -1))
    # [lead.., S, h/P, trail..] -> x's order of dims
    now = [*order[:lead], seq, head, *order[lead + 2 :]]
    inverse = sorted(range(len(now)), key=now.__getitem__)
    return y if inverse == list(range(len(now))) else g.call_function(torch.permute, (y, inverse))


def _to_sequence(rw: "SPRewrite", ulysses: Any, x: fx.Node, head: int, seq: int, shape: Any) -> fx.Node:
    """The inverse of :func:`_to_heads`: ``x`` (every position of the rank's heads) rearranged as
    ``[lead.., h/P, S, D]`` (its dims after both flattened into ``D``, or a ``D`` of 1), exchanged
    by the scheme, and arranged back as the rank's positions with every head."""
    g = rw.graph
    order = heads_order(head, seq, len(shape))
    lead = order.index(head)
    trail = [int(shape[d]) for d in order[lead + 2 :]]
    identity = order == sorted(order)
    y = x if identity else g.call_function(torch.permute, (x, order))
    y = g.call_function(torch.unsqueeze, (y, -1)) if not trail else y
    y = g.call_function(torch.flatten, (y, lead + 2)) if len(trail) > 1 else y
    y = ulysses.to_sequence(rw, y, lead, lead + 1)
    y = g.call_function(torch.squeeze, (y, -1)) if not trail else y
    y = g.call_function(torch.unflatten, (y, -1, trail)) if len(trail) > 1 else y
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return y if identity else g.call_function(torch.permute, (y, inverse))
