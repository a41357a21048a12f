"""Unit tests, no process group: the sequence-split arithmetic (layout.py), the size algebra of
placements (passes/placement.py) and the rule registry (passes/sp_rules/registry.py)."""

import operator

import pytest
import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.functions import FloorDiv

from autosp.layout import check_sequence_fits, chunk_size, seq_split_sizes, shard_window
from autosp.passes.placement import Shard, SizeEmitter, is_polynomial_quotient
from autosp.passes.sp_rules import lookup, op, sp_rule


def _positions_by_rank(seq_len: int, sp_size: int, offset: int, length: int) -> list[list[int]]:
    """Brute force: axis position i is base position offset + i, owned by the rank whose
    base chunk holds it."""
    chunk = -(-seq_len // sp_size)
    return [[i for i in range(length) if min((offset + i) // chunk, sp_size - 1) == r] for r in range(sp_size)]


@pytest.mark.parametrize("seq_len,sp_size", [(8, 2), (7, 2), (11, 3), (16, 4), (15, 4), (31, 8)])
@pytest.mark.parametrize("offset,trim", [(0, 0), (0, 1), (1, 0), (1, 1), (2, 1)])
def test_shard_window_matches_brute_force(seq_len, sp_size, offset, trim):
    length = seq_len - offset - trim
    assert seq_split_sizes(seq_len, sp_size)[-1] > max(offset, trim)  # the window math needs a token left
    chunk = chunk_size(seq_len, sp_size)
    expected = _positions_by_rank(seq_len, sp_size, offset, length)
    for rank in range(sp_size):
        start, count = shard_window(rank, sp_size, chunk, length, offset)
        assert list(range(start, start + count)) == expected[rank]
    assert sum(shard_window(r, sp_size, chunk, length, offset)[1] for r in range(sp_size)) == length


def test_seq_split_sizes():
    assert seq_split_sizes(8, 2) == [4, 4]
    assert seq_split_sizes(10, 4) == [3, 3, 3, 1]
    assert seq_split_sizes(5, 4) == [2, 2, 2, -1]  # too short: check_sequence_fits refuses it
    # negative control: not torch.tensor_split, which spreads the remainder over the first ranks
    assert seq_split_sizes(10, 3) == [4, 4, 2] != [len(c) for c in torch.arange(10).tensor_split(3)]


def test_check_sequence_fits():
    check_sequence_fits(12, 4, shift=1)  # last rank holds 3: 2 left after the slice
    with pytest.raises(ValueError, match=r"sequence of 8 tokens split over sp_size=4 ranks leaves the last rank 2 token"):
        check_sequence_fits(8, 4, shift=1)  # 1 left after the slice: Dynamo would specialize it
    check_sequence_fits(8, 4, shift=0)
    with pytest.raises(ValueError, match=r"last rank 1 token\(s\); it needs at least 2"):
        check_sequence_fits(7, 4, shift=0)
    for sp_size, shift in ((4, 1), (8, 2), (3, 0)):  # the multiple the message recommends fits
        check_sequence_fits((shift + 2) * sp_size, sp_size, shift)


def _evaluate(exprs, seq_len: int, sp_size: int) -> list[int]:
    """Emit ``exprs`` into a graph whose only input is the sequence length, then run it."""
    s = sympy.Symbol("s", integer=True, positive=True)
    graph = fx.Graph()
    s_node = graph.placeholder("s")
    emitter = SizeEmitter(graph, {s: lambda: s_node}, s, sp_size)
    chunk = emitter.chunk
    values = [emitter.emit(e(s, chunk)) for e in exprs]
    graph.output(tuple(values))
    return list(fx.GraphModule(torch.nn.Module(), graph)(seq_len))


@pytest.mark.parametrize("seq_len,sp_size", [(8, 2), (7, 2), (10, 3), (13, 4)])
def test_size_emitter_computes_the_expressions(seq_len, sp_size):
    exprs = [
        lambda s, c: c,
        lambda s, c: s - (sp_size - 1) * c,  # the last rank's tokens
        lambda s, c: 3 * c * s + 2,
        lambda s, c: c**2,
        lambda s, c: FloorDiv(s, 2),
        lambda s, c: sympy.Integer(5),
    ]
    chunk = -(-seq_len // sp_size)
    expected = [chunk, seq_len - (sp_size - 1) * chunk, 3 * chunk * seq_len + 2, chunk**2, seq_len // 2, 5]
    assert _evaluate(exprs, seq_len, sp_size) == expected
    # negative control: the chunk is ceil(S / P), not floor
    if seq_len % sp_size:
        assert _evaluate([lambda s, c: c], seq_len, sp_size)[0] != seq_len // sp_size


def test_size_emitter_refuses_unknown_symbols():
    s, other = sympy.symbols("s other", integer=True, positive=True)
    graph = fx.Graph()
    node = graph.placeholder("s")
    with pytest.raises(KeyError, match="other"):
        SizeEmitter(graph, {s: lambda: node}, s, 2).emit(other + 1)


def test_placement_algebra():
    s, b = sympy.symbols("s b", integer=True, positive=True)
    assert is_polynomial_quotient(b * s * 4, s) == 4 * b
    assert is_polynomial_quotient(s + 1, s) is None
    assert is_polynomial_quotient(sympy.Integer(12), sympy.Integer(5)) is None
    shard = Shard(1, s)
    assert shard.with_dim(2) == Shard(2, s)
    assert shard.same_layout(Shard(3, s)) and not shard.same_layout(Shard(1, s - 1, off=1))


def _traced_nodes():
    def f(x, y):
        a = torch.add(x, y)
        b = x + y
        c = x.add(y)
        x.add_(y)
        d = x.shape
        e = torch.sum(x, 1)
        g = x.sum(1)
        h = torch.flip(x, (1,))
        return a, b, c, d, e, g, h

    nodes = {n.name: n for n in fx.symbolic_trace(f).graph.nodes}
    return [nodes[name] for name in ("add", "add_1", "add_2", "add_", "getattr_1", "sum_1", "sum_2", "flip")]


def test_registry_normalises_every_spelling():
    add_fn, add_op, add_method, add_inplace, shape, sum_fn, sum_method, flip = _traced_nodes()
    found = [lookup(n) for n in (add_fn, add_op, add_method, add_inplace)]
    assert {call.name for call, _ in found} == {"add"}
    assert len({rule for _, rule in found}) == 1  # one rule for every spelling
    assert [call.inplace for call, _ in found] == [False, False, False, True]
    assert lookup(shape)[0].name == "size"
    assert lookup(sum_fn)[0].name == lookup(sum_method)[0].name == "sum"
    assert lookup(flip) is None  # no rule: the pass runs it replicated


def test_registry_refuses_a_second_rule_for_an_op():
    with pytest.raises(ValueError, match="two sequence-parallel rules"):
        sp_rule(op("add", operator.add))(lambda rw, node, call: None)
