"""Moved to `zero_engine.testing.device_guard`; the old name stays importable (the same module)."""

import sys

from .testing import device_guard as _moved

sys.modules[__name__] = _moved
