"""autosp: compiler-based sequence parallelism (AutoSP) for PyTorch, without a framework.

The core of lightning-autosp, importable without Lightning: the ``dp x sp`` layout and its
meshes, the compiled step that rewrites a Dynamo graph into DeepSpeed-Ulysses sequence
parallelism, the sequence-parallel sampler and the sharded mode. ``lightning_autosp`` puts the
same core behind a Lightning Trainer strategy and a Fabric strategy.
"""

import torch

from autosp import _compat

# before anything that compiles: an untested torch fails here, by name
_compat.check_torch(torch.__version__)

from autosp.errors import AutoSPError  # noqa: E402
from autosp.layout import SPLayout  # noqa: E402
from autosp.mesh import sp_mesh  # noqa: E402
from autosp.modes import FSDPConfig, Mode, Replicated, Sharded, make_mode  # noqa: E402
from autosp.sampler import SequenceParallelSampler  # noqa: E402
from autosp.steps import StepConfig, StepRunner  # noqa: E402
from autosp.passes.sp_rules.mixers import Heads, PerHead, Whole, register_mixer  # noqa: E402

__all__ = [
    "AutoSPError", "SPLayout", "sp_mesh", "SequenceParallelSampler", "StepConfig", "StepRunner",
    "FSDPConfig", "Mode", "Replicated", "Sharded", "make_mode", "register_mixer", "Heads", "PerHead", "Whole",
]
__version__ = "0.1.0"
