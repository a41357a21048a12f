"""Compile a rewritten graph with the sequence length as ``sp_size * c - r``.

Dynamo traces the step with the global sequence length ``s`` as a symbol. After the SP pass,
every activation of one rank is ``ceil(s / P)`` tokens long (fewer on the last rank), and AOT
autograd and inductor carry that ``FloorDiv`` (and the last rank's ``s - (P-1) * ((s+P-1)//P)``)
through every shape of the forward and backward. Symbolic arithmetic on such expressions is far
slower than on plain symbols, and it is most of what the SP rewrite adds to compile time.

So the backend compiles the rewritten graph in a shape environment of its own, where the
sequence length is written ``P*c - r``: ``c`` (the tokens of every rank but the last) is a
plain symbol and ``r = P*c - s`` (``0 <= r < P``) a constant. ``(s + P - 1) // P`` then
simplifies to ``c`` and every local length is a polynomial in ``c``. Every other size symbol of
the graph's inputs gets a fresh symbol of its own.

The guards that AOT autograd and inductor add while compiling land in that environment, not in
Dynamo's, so :class:`LocalShapeCompiled` checks them itself on every new set of sizes (and ``r``)
before calling the compiled code, and compiles again for sizes they reject: a call never runs
code compiled under assumptions its sizes break.

Graphs whose inputs cannot be rebuilt faithfully (inputs sharing storage, views with a storage
offset, sizes that are expressions rather than symbols) are compiled in Dynamo's environment as
before (:func:`build_local_shapes` returns ``None``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from autosp.layout import chunk_size

__all__ = ["LocalShapes", "build_local_shapes", "LocalShapeCompiled", "add_chunk_input"]

log = logging.getLogger(__name__)

#: how one symbol's value is read from the graph's runtime arguments: (input index, dim or None for a SymInt input)
Getter = tuple[int, Optional[int]]


def _expr(v: Any) -> Optional[sympy.Expr]:
    if isinstance(v, torch.SymInt):
        return v.node.expr
    if isinstance(v, int):
        return sympy.Integer(v)
    return None


@dataclass
class LocalShapes:
    """The fake inputs of one compile in its own shape environment, and how to tell whether a
    call's sizes satisfy what that compile assumed."""

    env: ShapeEnv
    mode: FakeTensorMode
    inputs: list[Any]
    sp_size: int
    #: the symbol of the per-rank chunk ``c`` and the constant ``r`` (``s + offset = sp_size * c - r``);
    #: ``remainder=None``: a general compile, where ``s`` has its own symbol (in ``others``) and
    #: ``c`` is an input the graph does not use
    chunk: sympy.Symbol
    remainder: Optional[int]
    #: where the global sequence length is read from the arguments
    seq_getter: Getter
    #: the pass splits ``s + offset`` positions (``offset=-1``: the step runs the model on ``tokens[:, :-1]``)
    offset: int = 0
    #: the other size symbols (fresh ones, in ``env``) and where their values are read
    others: dict[sympy.Symbol, Getter] = field(default_factory=dict)
    #: Dynamo's size symbols and where their values are read
    dynamo_getters: dict[sympy.Symbol, Getter] = field(default_factory=dict)
    _accepted: set = field(default_factory=set, repr=False)

    def binding(self, args: tuple) -> Optional[dict[sympy.Symbol, int]]:
        """The values of this environment's symbols in a call, ``None`` if its sequence length
        has another remainder."""
        s = _read(args, self.seq_getter) + self.offset
        c = chunk_size(s, self.sp_size)
        if self.remainder is not None and self.sp_size * c - s != self.remainder:
            return None
        out = {self.chunk: c}
        for sym, getter in self.others.items():
            out[sym] = _read(args, getter)
        return out

    def accepts(self, args: tuple) -> bool:
        """Whether the call's sizes lie in the value ranges the compile assumed for its symbols
        and satisfy every guard it added (the guards' verdict cached per sizes)."""
        binding = self.binding(args)
        if binding is None:
            return False
        for sym, value in binding.items():
            vr = self.env.var_to_range.get(sym)
            if vr is not None and not vr.lower <= value <= vr.upper:
                log.debug("AutoSP: size %s=%d outside the compile's range [%s, %s]", sym, value, vr.lower, vr.upper)
                return False
        key = (tuple(sorted((str(k), v) for k, v in binding.items())), len(self.env.guards))
        if key in self._accepted:
            return True
        values = {k: sympy.Integer(v) for k, v in binding.items()}
        for guard in self.env.guards:
            verdict = sympy.sympify(guard.expr.xreplace(values))
            if verdict is not sympy.true:  # false, or a symbol the arguments do not give: compile again
                log.debug("AutoSP: sizes %s break the compile's guard %s", binding, guard.expr)
                return False
        self._accepted.add(key)
        return True

    def symbol_names(self) -> tuple[str, ...]:
        return (str(self.chunk), *(str(s) for s in self.others))

    def length_symbols(self) -> dict[str, tuple[int, Optional[int], int]]:
        """The symbols that follow the global sequence length ``S`` (see
        :attr:`~autosp.passes.accounting.SavedActivations.length_symbols`)."""
        out: dict[str, tuple[int, Optional[int], int]] = {str(self.chunk): (self.sp_size, self.remainder, self.offset)}
        out.update({str(sym): (1, None, 0) for sym, getter in self.others.items() if getter == self.seq_getter})
        return out

    def symbol_values(self, args: tuple) -> tuple[int, ...]:
        """The values of :meth:`symbol_names` in a call this compile accepts."""
        b = self.binding(args)
        if b is None:
            raise ValueError("the call's sequence length has another remainder than this compile's")
        return tuple(b[s] for s in (self.chunk, *self.others))


def _read(args: tuple, getter: Getter) -> int:
    i, d = getter
    return int(args[i]) if d is None else int(args[i].shape[d])


def _hints(env: ShapeEnv) -> dict:
    """The example value of each backed symbol (``backed_var_to_val`` from torch 2.13 on)."""
    return getattr(env, "backed_var_to_val", None) or env.var_to_val


def _fake_mode_of(example_inputs: list[Any]) -> Optional[FakeTensorMode]:
    return next((x.fake_mode for x in example_inputs if isinstance(x, FakeTensor)), None)


class _Unsupported(Exception):
    """An input size that cannot be rebuilt in the new environment."""


def build_local_shapes(
    example_inputs: list[Any], seq: Any, sp_size: int, hints: Optional[dict[sympy.Symbol, int]] = None,
    exact: bool = True, offset: int = 0,
) -> Optional[LocalShapes]:
    """Fake inputs for compiling in a fresh shape environment with ``seq + offset = sp_size*c - r``
    (``exact=False``: with ``seq`` a symbol of its own, for every remainder); ``offset`` is
    :attr:`~autosp.passes.rewrite.SPPassStats.seq_offset`.

    ``example_inputs`` are the example values Dynamo recorded for the graph's inputs (fake
    tensors, SymInts) and ``seq`` the sequence symbol (or its name). ``hints`` gives the values
    of Dynamo's size symbols to compile for (default: Dynamo's example values). ``None`` when
    the inputs cannot be rebuilt faithfully (see the module docstring).
    """
    old_mode = _fake_mode_of(example_inputs)
    if old_mode is None or old_mode.shape_env is None:
        return None
    old_env = old_mode.shape_env
    storages: set = set()
    getters: dict[sympy.Symbol, Getter] = {}
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.SymInt):
            e = x.node.expr
            if isinstance(e, sympy.Symbol):
                getters.setdefault(e, (i, None))
            elif not e.is_number:
                return None
        elif isinstance(x, torch.Tensor):
            if not isinstance(x, FakeTensor):
                return None
            if x.is_sparse or x.layout != torch.strided or _expr(x.storage_offset()) != 0:
                return None
            key = id(x.untyped_storage())
            if key in storages:  # aliased inputs: AOT autograd must see the aliasing
                return None
            storages.add(key)
            for d, size in enumerate(x.shape):
                e = _expr(size)
                if isinstance(e, sympy.Symbol):
                    getters.setdefault(e, (i, d))
                elif not e.is_number:
                    return None
        elif x is not None and not isinstance(x, (int, float, bool, torch.Generator)):
            return None
    seq = next((sym for sym in getters if str(sym) == str(seq)), None)
    if seq is None:
        return None

    def hint(sym: sympy.Symbol) -> int:
        if hints is not None and sym in hints:
            return int(hints[sym])
        return int(_hints(old_env)[sym])

    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env)
    s_val = hint(seq) + offset
    c_val = chunk_size(s_val, sp_size)
    remainder = sp_size * c_val - s_val
    chunk = env.create_symbol(c_val, ConstantSource("autosp_chunk"), dynamic_dim=DimDynamic.DYNAMIC)
    if not isinstance(chunk, sympy.Symbol):  # specialized (c == 1): nothing to gain
        return None
    subs: dict[sympy.Symbol, sympy.Expr] = {seq: sp_size * chunk - remainder - offset} if exact else {}
    others: dict[sympy.Symbol, Getter] = {}
    for sym, getter in getters.items():
        if sym in subs:
            continue
        # the range Dynamo allows: a dynamic int input (a step counter) may be 0, 1 or negative,
        # a size is at least 2 (Dynamo specializes 0 and 1)
        low = old_env.var_to_range[sym].lower if sym in old_env.var_to_range else 2
        wide = dict(positive=None, do_not_specialize_zero_one=True) if low < 2 else {}
        new = env.create_symbol(hint(sym), ConstantSource(f"autosp_{sym}"), dynamic_dim=DimDynamic.DYNAMIC, **wide)
        if not isinstance(new, sympy.Symbol):  # specialized to a constant: no guard would say so
            return None
        others[new] = getter
        subs[sym] = new
    old_values = {sym: hint(sym) for sym in getters}

    def symint(v: Any) -> Any:
        e = _expr(v)
        if e is None or e.is_number:
            return v
        if not e.free_symbols <= set(subs):
            raise _Unsupported
        new = sympy.expand(e.xreplace(subs))
        h = int(e.xreplace({k: sympy.Integer(val) for k, val in old_values.items()}))
        if new.is_number:
            return int(new)
        return env.create_symintnode(new, hint=h)

    inputs: list[Any] = [env.create_symintnode(chunk, hint=c_val)]  # the graph's first input (see add_chunk_input)
    try:
        for x in example_inputs:
            if isinstance(x, torch.SymInt):
                inputs.append(symint(x))
            elif isinstance(x, torch.Tensor):
                with mode:
                    t = torch.empty_strided(
                        [symint(d) for d in x.shape], [symint(d) for d in x.stride()], dtype=x.dtype, device=x.device,
                        requires_grad=x.requires_grad,
                    )
                inputs.append(t)
            else:
                inputs.append(x)
    except _Unsupported:
        return None
    return LocalShapes(env, mode, inputs, sp_size, chunk, remainder if exact else None, getters[seq], offset, others, getters)


class LocalShapeCompiled:
    """The compiled graph(s) of one Dynamo graph, each compiled in its own shape environment;
    a call runs the first whose guards its sizes satisfy, compiling a new one if none does."""

    def __init__(
        self, compile_fn: Callable[[list[Any], "LocalShapes"], Callable], first: LocalShapes, example_inputs: list[Any],
        seq: str, on_call: Optional[Callable[[int, LocalShapes, tuple], None]] = None,
    ) -> None:
        self._compile_fn = compile_fn
        self._on_call = on_call
        self._example_inputs = example_inputs
        self._seq = seq
        self._dynamo_getters = first.dynamo_getters
        self.variants: list[tuple[LocalShapes, Callable]] = []
        self._add(first)

    def _add(self, local: LocalShapes) -> None:
        with tracing(TracingContext(local.mode)):
            compiled = self._compile_fn(local.inputs, local)
        self.variants.append((local, compiled))

    def __call__(self, *args: Any) -> Any:
        for index, (local, compiled) in enumerate(self.variants):
            if local.accepts(args):
                return self._run(index, args)
        hints = {sym: _read(args, g) for sym, g in self._dynamo_getters.items()}
        # one general compile (the sequence length a symbol of its own) serves every other remainder
        first = self.variants[0][0]
        local = build_local_shapes(self._example_inputs, self._seq, first.sp_size, hints, exact=False, offset=first.offset)
        if local is None:  # the same inputs were built once, so only a size of 0 or 1 gets here
            raise RuntimeError(f"AutoSP: cannot compile the step for the sizes {hints} (a size of 0 or 1?)")
        log.info(
            "AutoSP: compiling the step again for sequence length %d, outside what the earlier compiles assumed "
            "(their sequence length modulo sp_size, or a size guard)", _read(args, local.seq_getter),
        )
        self._add(local)
        if not local.accepts(args):
            raise RuntimeError("AutoSP: a graph compiled for these sizes does not accept them (guards of the compile fail)")
        return self._run(len(self.variants) - 1, args)

    def _run(self, index: int, args: tuple) -> Any:
        local, compiled = self.variants[index]
        if self._on_call is not None:
            self._on_call(index, local, args)
        return compiled(chunk_size(_read(args, local.seq_getter) + local.offset, local.sp_size), *args)


def add_chunk_input(gm: torch.fx.GraphModule) -> None:
    """Give ``gm`` a first input, the per-rank chunk ``c``: inductor binds the size symbols of
    its generated code from its inputs, and ``c`` is otherwise only part of expressions
    (``P*c - r``)."""
    first = next(iter(gm.graph.nodes))
    with gm.graph.inserting_before(first):
        gm.graph.placeholder("autosp_chunk")
    gm.recompile()
