"""The sharded mode (``fsdp=True`` / ``"hybrid"``): parameters, gradients and optimizer state as
DTensor shards."""
