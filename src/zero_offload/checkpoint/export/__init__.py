"""A checkpoint (or a live engine) out as Hugging Face's safetensors layout: the consolidation of
the rank files into full tensors (``consolidate.py``), the sharded layout written as a stream
(``sharded.py``) and its publication into the output folder (``publish.py``, ``folder_swap.py``)."""
