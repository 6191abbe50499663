"""Deprecated: moved to `zero_engine.config.deepspeed_compat`. Importing it from here still works, with a
`DeprecationWarning`; import it from its new home."""

import warnings

from .config import deepspeed_compat as _moved

warnings.warn(
    "zero_engine.deepspeed_compat moved to zero_engine.config.deepspeed_compat: import it from there",
    DeprecationWarning,
    stacklevel=2,
)
globals().update({name: value for name, value in vars(_moved).items() if not name.startswith("__")})
