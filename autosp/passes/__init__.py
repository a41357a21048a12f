"""Compiler passes: pure functions ``GraphModule -> GraphModule`` with a stated postcondition."""

from autosp.passes.sequence_parallel import SPPassStats, sequence_parallel_pass

__all__ = ["sequence_parallel_pass", "SPPassStats"]
