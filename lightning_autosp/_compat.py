"""Every torch version gate of the package lives here."""

from __future__ import annotations

import torch.distributed as dist

# torch >= 2.10 renamed reduce_scatter_tensor (the old name warns on every call).
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def graph_break_counter() -> dict:
    """Dynamo's running count of graph breaks by reason (read-only use, for error messages)."""
    from torch._dynamo.utils import counters

    return dict(counters.get("graph_break", {}))
