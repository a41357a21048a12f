"""Full garbage collections deferred while AutoSP compiles (autosp._gc)."""

import gc

import pytest
import torch

from autosp import _gc
from autosp._gc import DEFERRED_THRESHOLD, full_collections_deferred
from autosp.backend import AutoSPBackend


@pytest.fixture(autouse=True)
def thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)
    assert _gc._depth == 0


def test_deferred_inside_restored_after():
    with full_collections_deferred():
        assert gc.get_threshold() == (700, 10, DEFERRED_THRESHOLD)
        with full_collections_deferred():  # nested: the outermost one decides
            assert gc.get_threshold() == (700, 10, DEFERRED_THRESHOLD)
        assert gc.get_threshold() == (700, 10, DEFERRED_THRESHOLD)
    assert gc.get_threshold() == (700, 10, 10)


def test_restored_when_the_compile_raises():
    with pytest.raises(ValueError, match="boom"):
        with full_collections_deferred():
            raise ValueError("boom")
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("setting", [(0, 10, 10), (700, 10, 2 * DEFERRED_THRESHOLD)], ids=["collector-off", "higher"])
def test_the_process_settings_are_left_alone(setting):
    gc.set_threshold(*setting)
    with full_collections_deferred():
        assert gc.get_threshold() == setting
    assert gc.get_threshold() == setting


def test_a_threshold_set_during_the_compile_is_kept():
    with full_collections_deferred():
        gc.set_threshold(500, 5, 5)
    assert gc.get_threshold() == (500, 5, 5)


def _thresholds_seen_by_collections(backend) -> list:
    """The gc thresholds at every collection during one compile and step of a small MLP."""
    seen = []

    def callback(phase, info):
        if phase == "start":
            seen.append(gc.get_threshold())

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    gc.callbacks.append(callback)
    try:
        torch.compile(lambda a: model(a).sum(), backend=backend)(torch.randn(4, 8)).backward()
    finally:
        gc.callbacks.remove(callback)
    return seen


def test_the_backend_compiles_with_full_collections_deferred():
    seen = _thresholds_seen_by_collections(AutoSPBackend(sp_size=2, sp_rank=0, group_name="unused", backend="aot_eager"))
    assert any(t[2] == DEFERRED_THRESHOLD for t in seen)  # collections ran during the compile, with the raised threshold
    assert gc.get_threshold() == (700, 10, 10)
    # negative control: torch's own aot_eager compiles with the process's thresholds throughout
    plain = _thresholds_seen_by_collections("aot_eager")
    assert plain and all(t == (700, 10, 10) for t in plain)
