"""From a JSON file, a dict or a config to a validated config (``load.py``): reading the text
(``json_text.py``), dotted keys (``dotted.py``), the removed and the accepted-but-not-built
DeepSpeed keys (``removed.py``, ``unbuilt.py``), unknown keys against the section models
(``keys.py``), non-finite numbers (``finite.py``), ``"auto"`` values (``auto.py``, and the sizes
filled from the model, ``auto_sizes.py``) and the file a dict was read from (``origin.py``).

Nothing is imported here, so a section model may import one of these modules without importing
the loader (which imports every section)."""
