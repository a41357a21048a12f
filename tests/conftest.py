import multiprocessing
import os

import pytest
import torch

# One thread per process: the multi-process tests run 2-4 processes on 2 cores.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor tests share one cache so that only the first compile is cold.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor"))


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Where the ranks start from a fork server (sp_harness.START_METHOD), it imports the harness - and
# with it torch, Lightning and lightning_autosp - and the compile stack once (importing compiles
# nothing), so that a rank starts in milliseconds rather than seconds.
multiprocessing.set_forkserver_preload(["sp_harness", "torch._dynamo", "torch._inductor.compile_fx"])
