"""Shard states: the master shard and moments of one group behind one interface: in memory,
aliased to the param home's own fp32 values, or cut between device and host (twin)."""
