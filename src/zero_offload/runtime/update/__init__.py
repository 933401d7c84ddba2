"""The optimizer update: where each state lives (``Placement``), the shard states, the update
paths per placement, and where the updated 16-bit values go (param homes)."""
