"""DeepSpeed's engine accessors and calls (mixins of the engine): the training-loop API
(``engine_api``), the attribute surface Hugging Face and DeepSpeed users read (``engine_compat``),
and ``engine.compile``."""
