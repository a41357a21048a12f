import logging
import multiprocessing
import os

import pytest
import torch

# One thread per process: the multi-process tests run 2-4 processes on 2 cores.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor tests share one cache so that only the first compile is cold.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor"))
# torch's structured trace log (TORCH_TRACE, for tlparse) does not propagate, and pytest >= 9
# attaches its capture handlers to every logger that does not: each compile in the test process
# (and in the ranks forked from it) then builds its trace payloads and a failing test prints
# pages of empty 'DEBUG torch.__trace' records. Propagating, it gets no handler of pytest's and,
# as outside pytest, none at all (torch's lazy handler removes itself when TORCH_TRACE is unset).
if not os.environ.get("TORCH_TRACE"):
    logging.getLogger("torch.__trace").propagate = True


# The two tiers (pyproject.toml's markers, docs/testing.md): plain `pytest` (`make test`) runs the
# default tier - every unit test and one end-to-end fit per feature with its negative control;
# `pytest --all` (`make test-all`, CI), or AUTOSP_TESTS=all, also the tests marked `full`.
def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", help="run the full tier: the tests marked `full` too (also AUTOSP_TESTS=all)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--all") or os.environ.get("AUTOSP_TESTS") == "all":
        return
    full = [item for item in items if item.get_closest_marker("full")]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if not item.get_closest_marker("full")]


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Where the ranks start from a fork server (sp_harness.START_METHOD), it imports the harness - and
# with it torch, Lightning and lightning_autosp - and the compile stack once (importing compiles
# nothing), so that a rank starts in milliseconds rather than seconds.
multiprocessing.set_forkserver_preload(["sp_harness", "torch._dynamo", "torch._inductor.compile_fx"])
