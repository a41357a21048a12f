"""The rewritten graph compiled in a shape environment of its own (autosp/ops/local_shapes.py):
local lengths become plain polynomials of one symbol, and the compile's guards are checked on
every call by AutoSP itself (Dynamo never sees them)."""

import pytest
import sympy
import torch
from torch.utils._sympy.functions import FloorDiv

from autosp.backend import _example_values
from autosp.layout import chunk_size
from autosp.ops.local_shapes import LocalShapeCompiled, build_local_shapes
from autosp.passes.sequence_parallel import find_sequence_symbol
from sp_harness import make_model
from test_pass import batch, capture


def _graph(S):
    gm = capture(make_model("llama"), *batch(S))
    return gm, _example_values(gm), find_sequence_symbol(gm, 1)


def _real_args(values, seq, S):
    """Real arguments for a graph whose example values are ``values``, at sequence length ``S``."""
    def concrete(d):
        return int(d.node.expr.xreplace({seq: sympy.Integer(S)})) if isinstance(d, torch.SymInt) else int(d)

    args = []
    for v in values:
        if isinstance(v, torch.SymInt):
            args.append(concrete(v))
        elif isinstance(v, torch.Tensor):
            args.append(torch.zeros([concrete(d) for d in v.shape], dtype=v.dtype))
        else:
            args.append(v)
    return tuple(args)


def _expr(x):
    return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(x)


def test_sequence_length_is_a_polynomial_of_the_chunk():
    _, values, seq = _graph(15)
    local = build_local_shapes(values, seq, 4)
    assert local is not None and local.remainder == 1  # 15 = 4*4 - 1
    c = local.chunk
    assert local.symbol_values(_real_args(values, seq, 15)) == (4,)
    # the first input is the chunk itself; every sequence dim of the others is 4*c - 1
    assert _expr(local.inputs[0]) == c
    seq_dims = [_expr(d) for x in local.inputs[1:] if isinstance(x, torch.Tensor) for d in x.shape if not _expr(d).is_number]
    assert seq_dims and all(sympy.expand(e - (4 * c - 1)) == 0 for e in seq_dims)
    # what the SP pass computes from the length simplifies to plain symbols: no FloorDiv
    s = local.env.create_symintnode(4 * c - 1, hint=15)
    per_rank = chunk_size(s, 4)
    assert _expr(per_rank) == c
    last = s - 3 * per_rank
    assert _expr(last) == c - 1 and not _expr(last).atoms(FloorDiv)
    # negative control: in Dynamo's environment the same arithmetic is a FloorDiv
    dynamo_s = next(d for v in values if isinstance(v, torch.Tensor) for d in v.shape if _expr(d) == seq)
    assert _expr(chunk_size(dynamo_s, 4)).atoms(FloorDiv)
    # a general compile (any remainder) keeps the length a symbol of its own
    general = build_local_shapes(values, seq, 4, exact=False)
    assert general.remainder is None
    assert {str(general.chunk): (4, None, 0)}.items() <= general.length_symbols().items()
    assert any(div == 1 for div, _, _ in general.length_symbols().values())


def test_inputs_that_share_storage_keep_dynamos_environment():
    _, values, seq = _graph(16)
    tensors = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    aliased = list(values)
    aliased[tensors[1]] = aliased[tensors[0]]  # the same tensor twice: AOT autograd must see the aliasing
    assert build_local_shapes(aliased, seq, 2) is None
    assert build_local_shapes(values, seq, 2) is not None


def test_a_call_whose_sizes_break_a_guard_compiles_again():
    """The compile below guards on ``c >= 6`` (as AOT autograd or inductor may); a call at 10
    tokens (c = 5) must not run it, and one at an odd length (another remainder) neither: each
    gets a general compile (the length a symbol of its own), which then serves what it accepts."""
    _, values, seq = _graph(16)
    local = build_local_shapes(values, seq, 2)
    compiles = []

    def compile_fn(inputs, variant):
        chunk = inputs[0]
        assert isinstance(chunk, torch.SymInt)
        big = bool(chunk >= 6)  # a guard in the variant's environment
        compiles.append(variant)
        index = len(compiles) - 1
        return lambda c, *args: (index, c, big)

    run = LocalShapeCompiled(compile_fn, local, values, str(seq))
    assert run(*_real_args(values, seq, 16)) == (0, 8, True)
    assert run(*_real_args(values, seq, 14)) == (0, 7, True)  # c=7 satisfies the guard: no compile
    assert len(compiles) == 1
    assert run(*_real_args(values, seq, 10)) == (1, 5, False)  # c=5 breaks c >= 6
    assert len(compiles) == 2 and compiles[1].remainder is None
    assert run(*_real_args(values, seq, 9)) == (1, 5, False)  # 9 = 2*5 - 1: the general compile serves it
    assert len(compiles) == 2
    assert run(*_real_args(values, seq, 15)) == (2, 8, True)  # c=8 breaks the general compile's c < 6
    assert len(compiles) == 3
    assert run(*_real_args(values, seq, 16))[0] == 0 and len(compiles) == 3
    # negative control: the first compile's remainder matches at 10 tokens, only its guard rejects them
    args10 = _real_args(values, seq, 10)
    assert local.binding(args10) is not None and not local.accepts(args10)


def test_saved_sizes_at_another_length_follow_the_compiles_symbols():
    """A record compiled for even lengths (S = 2c) evaluates at 64 tokens with c = 32, refuses an
    odd length (another compile's sizes), and a general record takes any length."""
    from autosp.passes.accounting import SavedActivations, SavedTensor

    c, s = sympy.Symbol("s7", integer=True, positive=True), sympy.Symbol("s8", integer=True, positive=True)
    exact = SavedActivations([SavedTensor("h", "linear", 4 * 16 * c, ("c", "16"), "float32")], symbols=("s7",), binding=(8,),
                             length_symbols={"s7": (2, 0, 0)})
    assert exact.bytes_by_kind()["linear"] == 4 * 16 * 8
    assert exact.bytes_by_kind(exact.binding_at(64))["linear"] == 4 * 16 * 32
    with pytest.raises(ValueError, match="compiled for sequence lengths"):
        exact.binding_at(63)
    general = SavedActivations([SavedTensor("h", "linear", 4 * s + c, ("s",), "float32")], symbols=("s7", "s8"), binding=(8, 15),
                               length_symbols={"s7": (2, None, 0), "s8": (1, None, 0)})
    assert general.bytes_by_kind(general.binding_at(63))["linear"] == 4 * 63 + 32


def test_a_dynamic_int_input_keeps_its_whole_range():
    """Dynamo lets a dynamic int input (a step counter) be 0, 1 or negative; the compile's own
    environment must not fix it to its first value (a size would be specialized at 0 or 1)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    _, values, seq = _graph(16)
    env = next(v for v in values if isinstance(v, torch.Tensor)).fake_mode.shape_env
    step = env.create_symintnode(env.create_unspecified_symbol(1, ConstantSource("step"), DimDynamic.DYNAMIC), hint=1)
    local = build_local_shapes([*values, step], seq, 2)
    assert local is not None and len(local.others) == 1  # a symbol, not the constant 1
    args = _real_args(values, seq, 16)
    assert all(local.accepts((*args, value)) for value in (0, 1, 5, -3))
