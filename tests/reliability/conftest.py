"""Make the shared test helpers (tests/distributed.py, tests/parity.py) importable here."""

import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
