"""The demo: users of the library do not need any of this (its models live in :mod:`autosp.models`).

* :mod:`.kv_recall` - the long-context key/value recall task (dataset and data module);
* :mod:`.causal_lm` - ``CausalLMModule``, the LightningModule the demo config trains.
"""
