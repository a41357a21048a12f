"""The sequence-parallel rules, one registered per op (see :mod:`.registry`).

Importing this package registers every rule: :mod:`.shape` (elementwise, views, indexing,
splits, sizes), :mod:`.tokenwise` (embedding, linear, norms, softmax-like ops),
:mod:`.reduction` (sums, means, losses), :mod:`.convolution` (short
convolutions along the sequence, with a halo), :mod:`.random_ops` (dropout and random tensors drawn
globally) and :mod:`.attention` (SDPA, parallelised by the run's attention scheme,
:mod:`autosp.passes.attention_schemes`).
"""

from autosp.passes.sp_rules import convolution, random_ops, reduction, shape, tokenwise  # noqa: F401  (registers the rules)
from autosp.passes.sp_rules.attention import SDPA
from autosp.passes.sp_rules.registry import OpCall, Rule, lookup, op, sp_rule

__all__ = ["lookup", "sp_rule", "op", "OpCall", "Rule", "SDPA"]
