"""The attention-parallelism seam: the SP pass parallelises each attention by asking the run's
scheme (autosp.passes.attention_schemes), and checks its postcondition with the same object."""

import pytest
import torch
from sp_harness import make_model
from test_pass import batch, capture

from autosp.errors import AutoSPError
from autosp.passes import sequence_parallel_pass
from autosp.passes.accounting import op_kind
from autosp.passes.attention_schemes import DEFAULT_SCHEME, Ulysses, get_scheme, register_scheme, schemes
from autosp.passes.sac import _ALWAYS_SAVED


class Recording(Ulysses):
    """Ulysses, counting what the pass asks of it."""

    name = "test_recording"

    def __init__(self):
        self.calls = {"check_heads": 0, "to_heads": 0, "to_sequence": 0, "reads_exchanged": 0, "writes_exchanged": 0}

    def check_heads(self, *args):
        self.calls["check_heads"] += 1
        return super().check_heads(*args)

    def to_heads(self, *args):
        self.calls["to_heads"] += 1
        return super().to_heads(*args)

    def to_sequence(self, *args):
        self.calls["to_sequence"] += 1
        return super().to_sequence(*args)

    def reads_exchanged(self, a):
        self.calls["reads_exchanged"] += 1
        return super().reads_exchanged(a)

    def writes_exchanged(self, u):
        self.calls["writes_exchanged"] += 1
        return super().writes_exchanged(u)


class Unchecked(Ulysses):
    """A broken scheme: it says no input came through its exchange."""

    name = "test_unchecked"

    def reads_exchanged(self, a):
        return False


class NoHeadSplit(Ulysses):
    name = "test_no_head_split"

    def check_heads(self, rw, where, heads, shape):
        raise AutoSPError(f"{where.name}: this scheme splits no heads")


def _registered(scheme):
    known = {s.name: s for s in schemes()}
    return known.get(scheme.name) or register_scheme(scheme)


def _targets(gm):
    return [n.target for n in gm.graph.nodes]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_the_pass_asks_the_scheme(kind):
    """A scheme registered under a name of its own is what the pass calls for every exchange and
    for its postcondition; Ulysses behind the seam emits the graph the default does."""
    recording = _registered(Recording())
    recording.calls = dict.fromkeys(recording.calls, 0)
    default = sequence_parallel_pass(capture(make_model(kind), *batch()), sp_size=2, sp_rank=1, group_name="unused")
    out = sequence_parallel_pass(capture(make_model(kind), *batch()), sp_size=2, sp_rank=1, group_name="unused", attention_scheme="test_recording")
    attention = out.meta["autosp"].sdpa
    assert attention == default.meta["autosp"].sdpa == 2 and _targets(out) == _targets(default)
    assert out.meta["autosp"].all_to_all == default.meta["autosp"].all_to_all == 4 * attention
    assert recording.calls == {
        "check_heads": attention, "to_heads": 3 * attention, "to_sequence": attention,
        "reads_exchanged": 3 * attention, "writes_exchanged": attention,
    }


def test_the_postcondition_is_the_schemes():
    """A scheme that disowns its exchanges fails the pass's postcondition (the check is asked of it)."""
    _registered(Unchecked())
    with pytest.raises(AutoSPError, match=r"internal: attention .* was not fully rewritten"):
        sequence_parallel_pass(capture(make_model("gpt"), *batch()), sp_size=2, sp_rank=1, group_name="unused", attention_scheme="test_unchecked")


def test_the_scheme_decides_the_head_split_and_names_are_checked():
    _registered(NoHeadSplit())
    with pytest.raises(AutoSPError, match=r"this scheme splits no heads"):
        sequence_parallel_pass(capture(make_model("gpt"), *batch()), sp_size=2, sp_rank=1, group_name="unused", attention_scheme="test_no_head_split")
    with pytest.raises(AutoSPError, match=r"attention_scheme='nonexistent': choose one of \[.*'ulysses'.*\]"):
        sequence_parallel_pass(capture(make_model("gpt"), *batch()), sp_size=2, sp_rank=1, group_name="unused", attention_scheme="nonexistent")


def test_sac_and_the_accounting_ask_the_schemes():
    """What Ulysses inserts is of its collective kind, which SAC always saves."""
    ulysses = get_scheme(DEFAULT_SCHEME)
    assert DEFAULT_SCHEME == "ulysses" and isinstance(ulysses, Ulysses)
    assert op_kind("autosp::seq_gather") == op_kind("autosp::seq_scatter") == ulysses.collective_kind == "all_to_all"
    assert ulysses.collective_kind in _ALWAYS_SAVED and "linear" not in _ALWAYS_SAVED
    assert op_kind("aten::mm") == "linear"
    with pytest.raises(ValueError, match="registered already"):
        register_scheme(Ulysses())
    assert torch.ops.autosp.seq_gather.default.namespace in ulysses.op_namespaces
