"""``offload_states`` / ``reload_states``: a group's device buffers (``OptimizerGroup.state_buffers``)
moved to the host and back, the params re-bound to the moved storages, and the check that the
hot path finds every state it needs on the device."""
