"""``zero-offload train``: the command and its training loop (``command.py``), what it trains
(``job.py``: the built-in GPT-2, or a Hugging Face causal LM folder, ``hf.py``), the run folder it
writes (``run_folder.py``) and its periodic checkpoints (``periodic_save.py``)."""
