"""Moved to `zero_engine.testing.process_memory`; the old name stays importable (the same module)."""

import sys

from .testing import process_memory as _moved

sys.modules[__name__] = _moved
