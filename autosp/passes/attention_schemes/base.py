"""The seam between the SP pass and a way of parallelising attention.

The pass keeps every tensor of the step on the rank's own tokens; attention is the one op that
needs every token. Where the pass finds attention (``F.scaled_dot_product_attention``, attention
written by hand, or either as the tiled kernel of a mask built from positions), it asks the
scheme of the run (:class:`AttentionScheme`) how to turn the rank's tokens into what that
attention can compute on, and back; the rest of the step - the pass's postcondition, SAC's
always-saved kinds, the saved-bytes accounting, ``CompiledStep.all_to_alls`` - asks the same
object what it inserted. Ulysses (:mod:`.ulysses`) is the one scheme today.

Adding one is a subclass in a file of its own, registered with :func:`register_scheme` and
imported by this package's ``__init__``; the pass takes it by name (``attention_scheme=``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch.fx as fx

from autosp.errors import AutoSPError

__all__ = ["AttentionScheme", "register_scheme", "get_scheme", "schemes", "DEFAULT_SCHEME"]

#: the scheme the pass uses unless told otherwise (:mod:`.ulysses`)
DEFAULT_SCHEME = "ulysses"

_SCHEMES: dict[str, "AttentionScheme"] = {}


class AttentionScheme:
    """How attention over the rank's tokens becomes attention a rank can compute, and back.

    Every layout is the model's ``[.., h, S, D]`` (heads, then positions); the pass hands the
    scheme q, k and v as this rank's shard of the positions with all heads (``[.., h, S_r, D]``)
    and takes attention's output back in the same layout. ``rw`` is the pass's
    :class:`~autosp.passes.rewrite.SPRewrite` (its graph, ``sp_size``, ``sp_rank``, group, stats).
    """

    #: the name the pass takes (``attention_scheme="ulysses"``)
    name: ClassVar[str]
    #: the op namespaces of the collectives it inserts (the accounting's kind ``collective_kind``)
    op_namespaces: ClassVar[tuple[str, ...]]
    #: the op kind of what it inserts, which SAC always saves (never recomputed in backward)
    collective_kind: ClassVar[str] = "all_to_all"
    #: every attention runs in :meth:`attend` (a score program: no SDPA call, no dense mask); a
    #: scheme that only exchanges (Ulysses) lets SDPA or the tiled kernel run on what it hands over
    owns_attention: ClassVar[bool] = False

    def head_split(self, rw: Any) -> int:
        """Into how many groups the heads split (KV heads that do not divide by it are repeated)."""
        raise NotImplementedError

    def check_heads(self, rw: Any, where: fx.Node, heads: int, shape: list) -> None:
        """Raise an :class:`~autosp.errors.AutoSPError` naming the fix if ``heads`` query heads
        (of q's ``shape``) cannot be split this way over ``rw.sp_size`` ranks."""
        raise NotImplementedError

    def heads_per_rank(self, rw: Any, heads: int) -> int:
        """How many of ``heads`` this rank computes attention for."""
        raise NotImplementedError

    def first_head(self, rw: Any, heads: int) -> int:
        """The first of this rank's heads (a mask or bias per head is narrowed to them)."""
        raise NotImplementedError

    def to_heads(self, rw: Any, x: fx.Node, heads: int, head_dim: int, seq_dim: int) -> fx.Node:
        """``[.., heads, S_r, D]`` (this rank's positions) -> what attention reads on this rank."""
        raise NotImplementedError

    def to_sequence(self, rw: Any, x: fx.Node, head_dim: int, seq_dim: int) -> fx.Node:
        """Attention's output on this rank -> ``[.., h, S_r, D]`` (this rank's positions)."""
        raise NotImplementedError

    def attend(self, rw: Any, q: fx.Node, k: fx.Node, v: fx.Node, program: Any, heads: int, device: Any) -> fx.Node:
        """Attention's output (``[.., h', S', Dv]``) on what :meth:`to_heads` handed over, with the
        logits of the score ``program`` (an :class:`~autosp.passes.sp_rules.score_program.ExtractedProgram`
        of ``heads`` query heads) on tensors of ``device``."""
        raise NotImplementedError

    def reads_exchanged(self, a: object) -> bool:
        """Whether attention's input ``a`` (a new-graph value) came through :meth:`to_heads`."""
        raise NotImplementedError

    def writes_exchanged(self, u: fx.Node) -> bool:
        """Whether attention's output ``u`` goes only through :meth:`to_sequence`."""
        raise NotImplementedError


def register_scheme(scheme: AttentionScheme) -> AttentionScheme:
    """Make ``scheme`` available to the pass under ``scheme.name``."""
    if scheme.name in _SCHEMES:
        raise ValueError(f"attention scheme {scheme.name!r} is registered already")
    _SCHEMES[scheme.name] = scheme
    return scheme


def get_scheme(name: str) -> AttentionScheme:
    if name not in _SCHEMES:
        raise AutoSPError(f"attention_scheme={name!r}: choose one of {sorted(_SCHEMES)}.")
    return _SCHEMES[name]


def schemes() -> tuple[AttentionScheme, ...]:
    """Every registered scheme (what SAC and the accounting ask of all of them)."""
    return tuple(_SCHEMES.values())
