"""The read path: a checkpoint folder opened and checked (``reader.py``), each rank's shard mapped
from the saved layout to the current one by param name and index (``reslice.py``), the plan of
what each rank reads (``load_plan.py``) and ``load_checkpoint`` (``load.py``)."""
