"""The sequence-parallel rules, one registered per op (see :mod:`.registry`).

Importing this package registers every rule: :mod:`.shape` (elementwise, views, indexing,
splits, sizes), :mod:`.tokenwise` (embedding, linear, norms, softmax-like ops),
:mod:`.reduction` (sums, means, losses), :mod:`.random_ops` (dropout and random tensors drawn
globally) and :mod:`.attention` (Ulysses around SDPA).
"""

from autosp.passes.sp_rules import random_ops, reduction, shape, tokenwise  # noqa: F401  (registers the rules)
from autosp.passes.sp_rules.attention import SDPA, SEQ_GATHER, SEQ_SCATTER
from autosp.passes.sp_rules.registry import OpCall, Rule, lookup, op, sp_rule

__all__ = ["lookup", "sp_rule", "op", "OpCall", "Rule", "SDPA", "SEQ_GATHER", "SEQ_SCATTER"]
