"""What a rewritten graph runs: the custom ops the passes insert, each with its autograd rule.

* :mod:`.collectives` - the sequence all-to-alls, gathers and scatters (``autosp::...``);
* :mod:`.local_shapes` - positions and sizes of the rank's shard;
* :mod:`.fused_loss` - the vocabulary loss in chunks of tokens;
* :mod:`.tiled_attention` - attention with its mask evaluated tile by tile;
* :mod:`.tiled_rows` - a region of row-wise ops (an MLP with its norm) run tile by tile.
"""
