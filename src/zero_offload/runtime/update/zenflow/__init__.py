"""ZenFlow (DeepSpeed's stall-free offload): the top gradient columns of each 2-D param, and
every 1-D param, updated on the device at every step; the rest by the host update every
``update_interval`` steps from the gradients accumulated meanwhile (``update.py``)."""
