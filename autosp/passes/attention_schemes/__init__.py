"""How the SP pass parallelises each attention it finds (:mod:`.base`: the interface and the
registry): :mod:`.ulysses`, DeepSpeed-Ulysses, where the heads split over the SP group; and
:mod:`.ring`, Ulysses with a ring level under it, where they do not (the pass picks it for a
layout with ``ring > 1``)."""

from autosp.passes.attention_schemes.base import DEFAULT_SCHEME, AttentionScheme, get_scheme, register_scheme, schemes
from autosp.passes.attention_schemes.ulysses import Ulysses
from autosp.passes.attention_schemes.ring import Ring

__all__ = ["AttentionScheme", "Ulysses", "Ring", "get_scheme", "register_scheme", "schemes", "DEFAULT_SCHEME"]
