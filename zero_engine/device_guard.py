"""Deprecated: moved to `zero_engine.testing.device_guard`. Importing it from here still works, with a
`DeprecationWarning`; import it from its new home."""

import warnings

from .testing import device_guard as _moved

warnings.warn(
    "zero_engine.device_guard moved to zero_engine.testing.device_guard: import it from there", DeprecationWarning, stacklevel=2
)
globals().update({name: value for name, value in vars(_moved).items() if not name.startswith("__")})
