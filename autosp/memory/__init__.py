"""Activation memory on paper: the memory model of a step (:mod:`.model`, what ``lightning-autosp
plan`` and the benchmarks predict), the plan built on it (:mod:`.plan`) and what eager forwards
save (:mod:`.eager`). What compiled graphs save is recorded by :mod:`autosp.passes.accounting`."""
