"""Deprecated: moved to `zero_engine.testing.process_memory`. Importing it from here still works, with a
`DeprecationWarning`; import it from its new home."""

import warnings

from .testing import process_memory as _moved

warnings.warn(
    "zero_engine.process_memory moved to zero_engine.testing.process_memory: import it from there", DeprecationWarning, stacklevel=2
)
globals().update({name: value for name, value in vars(_moved).items() if not name.startswith("__")})
