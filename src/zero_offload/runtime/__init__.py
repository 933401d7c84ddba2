"""The engine's components: layout, flat groups, reducer, grad shard, shard optimizer, loss scaler."""
