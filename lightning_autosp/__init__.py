"""lightning-autosp: compiler-based sequence parallelism (AutoSP) as a Lightning strategy."""

import lightning
import torch

from lightning_autosp import _compat

# before anything that compiles or parses: an untested torch or Lightning fails here, by name
_compat.check_versions(torch.__version__, lightning.__version__)

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_autosp.monitor import ActivationMemoryMonitor  # noqa: E402
from autosp.errors import AutoSPError  # noqa: E402
from autosp.modes.sharded.values import grad_norm  # noqa: E402
from autosp.sampler import SequenceParallelSampler  # noqa: E402
from lightning_autosp.strategy import AutoSPStrategy  # noqa: E402

__all__ = ["AutoSPStrategy", "SequenceParallelSampler", "AutoSPError", "ActivationMemoryMonitor", "grad_norm"]
__version__ = "0.1.0"

if "autosp" not in StrategyRegistry:
    StrategyRegistry.register(
        "autosp",
        AutoSPStrategy,
        description="Ulysses sequence parallelism by compiler pass, one SP group per node",
    )

from lightning_autosp import fabric  # noqa: E402,F401  (registers "autosp" for Fabric too)
