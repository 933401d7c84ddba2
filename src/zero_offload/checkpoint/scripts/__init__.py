"""The standalone scripts every save writes beside ``latest`` and the checks they share with the
library: ``zero_to_fp32_script.py`` (written as ``zero_to_fp32.py``), ``zero_to_torch_script.py``
(as ``zero_to_torch.py``, reading through its sibling), ``meta_checks.py`` (the checks of
``meta.json``, standard library only, which the reader imports and ``script_source.py`` inlines
into the written ``zero_to_fp32.py``). These files import nothing of the package but each other:
they run where the package is not installed."""
