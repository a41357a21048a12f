"""Version gates: the import-time range check and the partitioner tags of older torch."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from autosp import _compat
from lightning_autosp._compat import LIGHTNING_RANGE, TORCH_RANGE, check_versions, release

ROOT = Path(__file__).resolve().parents[1]


def test_release_numbers():
    assert release("2.9.1+cu128") == (2, 9, 1)
    assert release("2.13.0+cpu") == (2, 13, 0)
    assert release("2.16.0a0+git1234abc") == (2, 16, 0)
    assert release("2.5.1.post0") == (2, 5, 1)
    with pytest.raises(ValueError, match="cannot read"):
        release("unknown")


@pytest.mark.parametrize(
    "torch_version,lightning_version,named",
    [
        ("2.8.0+cu128", "2.6.6", r"torch 2\.8\.0\+cu128 is installed, but lightning-autosp supports torch>=2\.9,<2\.16"),
        ("2.16.0", "2.6.6", r"torch 2\.16\.0 is installed"),
        ("2.16.0a0+git1234abc", "2.6.6", r"torch 2\.16\.0a0\+git1234abc is installed"),
        ("2.13.0+cpu", "2.4.0", r"lightning 2\.4\.0 is installed, but lightning-autosp supports lightning>=2\.5\.3,<2\.7"),
        ("2.13.0+cpu", "2.5.2", r"lightning 2\.5\.2 is installed"),
        ("2.13.0", "2.7.0", r"lightning 2\.7\.0 is installed"),
    ],
)
def test_versions_outside_the_range_are_rejected(torch_version, lightning_version, named):
    with pytest.raises(ImportError, match=named):
        check_versions(torch_version, lightning_version)


@pytest.mark.slow
def test_import_fails_fast_on_an_untested_torch():
    code = "import torch; torch.__version__ = '2.8.0+cu128'; import lightning_autosp"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "ImportError: lightning-autosp: torch 2.8.0+cu128 is installed" in out.stderr, out.stderr[-2000:]
    assert "torch>=2.9,<2.16" in out.stderr


def test_range_edges():
    assert TORCH_RANGE.contains("2.9.0") and TORCH_RANGE.contains("2.14.1+cu130") and TORCH_RANGE.contains("2.15.9+cu132")
    assert not TORCH_RANGE.contains("2.8.9") and not TORCH_RANGE.contains("2.16.0")
    assert LIGHTNING_RANGE.contains("2.5.3") and LIGHTNING_RANGE.contains("2.6.6")


def test_pyproject_declares_the_checked_ranges():
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert TORCH_RANGE.requirement in deps and LIGHTNING_RANGE.requirement in deps, deps


def _tagged_graph() -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.ops.aten.relu.default, (x,))
    b = graph.call_function(torch.ops.aten.neg.default, (a,))
    c = graph.call_function(torch.ops.aten.sin.default, (b,))
    graph.output(c)
    a.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    b.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    b.meta["ac_graph_id"] = 7  # already in a torch.utils.checkpoint region
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("needs_id", [True, False])
def test_recompute_tags_get_a_region_only_where_the_partitioner_needs_one(monkeypatch, needs_id):
    monkeypatch.setattr(_compat, "_PARTITIONER_NEEDS_AC_GRAPH_ID", needs_id)
    gm = _compat.prepare_recompute_tags(_tagged_graph())
    ids = [n.meta.get("ac_graph_id") for n in gm.graph.nodes]  # x, relu, neg, sin, output
    if needs_id:
        assert ids == [None, _compat.SAC_AC_GRAPH_ID, 7, None, None]
    else:
        assert ids == [None, None, 7, None, None]
