"""The memory estimator: what a rank keeps for its model states by stage and placement
(``memory.py``), the step's working set and peak per rank on the device, the host and NVMe
(``memory_model.py``: ``ZeroPlan`` from a config, ``StepShape``, ``predict``), the model's shape
it is computed from (``model_shape.py``) and the check of a working set against free memory
(``memory_bounds.py``). The engine checks its config with it at ``initialize`` and reports
against it; ``zero-offload estimate`` prints it. It builds nothing: plain numbers in and out."""
