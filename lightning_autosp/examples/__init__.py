"""The demo and the bundled models: users of the library do not need any of this.

* :mod:`.models` - small GPT and Llama models (plain PyTorch, ``F.scaled_dot_product_attention``),
  shared by the demo, the tests and the benchmarks;
* :mod:`.kv_recall` - the long-context key/value recall task (dataset and data module);
* :mod:`.causal_lm` - ``CausalLMModule``, the LightningModule the demo config trains.
"""
