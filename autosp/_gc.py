"""Full garbage collections deferred while AutoSP compiles.

A compile allocates on the order of a million tracked objects (FX nodes, fake tensors, sympy
expressions, symbolic sizes), most of which outlive a young collection. With CPython's default
thresholds a full (generation 2) collection then runs whenever the objects promoted since the
last one reach a quarter of the old generation, and each one walks every tracked object of the
process - about 0.7 s per collection in a 2-layer Llama benchmark process here, several of them
per compile of an 8-layer model. Repeating that walk while the heap grows buys nothing: the
compile's objects are alive until it ends.

:func:`full_collections_deferred` raises the generation-2 threshold for the duration of a
compile and restores the caller's thresholds afterwards. Young collections (generations 0 and
1) keep running, and objects without reference cycles are still freed the moment they die;
what waits is cyclic garbage already promoted to the old generation. Nothing is skipped: the
old generation's counter keeps counting, so the first young collection after the compile
whose old generation has grown enough runs the full collection. Nested uses share the
outermost one. A garbage collector the process disabled, or thresholds it set at least as
high, are left alone.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["full_collections_deferred", "DEFERRED_THRESHOLD"]

#: the generation-2 threshold while compiling: young collections between full ones
DEFERRED_THRESHOLD = 1_000_000

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] | None = None


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """Defer full garbage collections until the outermost ``with`` block ends (see the module)."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            current = gc.get_threshold()
            if current[0] > 0 and len(current) >= 3 and current[2] < DEFERRED_THRESHOLD:
                _saved = current
                gc.set_threshold(current[0], current[1], DEFERRED_THRESHOLD)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                if gc.get_threshold()[2] == DEFERRED_THRESHOLD:  # unless someone set their own meanwhile
                    gc.set_threshold(*_saved)
                _saved = None
