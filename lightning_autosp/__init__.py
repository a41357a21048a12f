"""lightning-autosp: compiler-based sequence parallelism (AutoSP) as a Lightning strategy."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_autosp.memory.monitor import ActivationMemoryMonitor
from lightning_autosp.errors import AutoSPError
from lightning_autosp.sampler import SequenceParallelSampler
from lightning_autosp.strategy import AutoSPStrategy

__all__ = ["AutoSPStrategy", "SequenceParallelSampler", "AutoSPError", "ActivationMemoryMonitor"]
__version__ = "0.1.0"

if "autosp" not in StrategyRegistry:
    StrategyRegistry.register(
        "autosp",
        AutoSPStrategy,
        description="Ulysses sequence parallelism by compiler pass, one SP group per node",
    )
