"""``zero-offload estimate``: the command (``command.py``: model-state memory per stage and
placement) and, with a model shape, the step's peak per rank and the largest model that fits
(``step.py``), both over the memory model of ``runtime/plan/``."""
