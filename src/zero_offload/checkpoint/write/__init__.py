"""The write path: ``save_checkpoint`` and ``save_16bit_model`` (``save.py``), with every tensor
checked finite as its rank file is written (``finite_state.py``)."""
