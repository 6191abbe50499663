"""Switched-on features that the config validates but the engine does not build yet.

Each one fails at `initialize` with `NotImplementedError` naming its key, never silently
ignored. Settings that are off, or that mean "off" (``gradient_clipping: 0``), always pass.
"""

from __future__ import annotations

from .config import ZeroEngineConfig


def unbuilt_features(config: ZeroEngineConfig) -> list[str]:
    """Key paths of the switched-on features this version cannot run."""
    zero = config.zero_optimization
    found = []
    for key in ("offload_optimizer", "offload_param"):
        offload = getattr(zero, key)
        if offload is not None and offload.device != "none":
            found.append(f"zero_optimization.{key}.device = {offload.device!r} (offloading)")
    return found


def refuse_unbuilt_features(config: ZeroEngineConfig) -> None:
    found = unbuilt_features(config)
    if found:
        raise NotImplementedError("not built yet: " + "; ".join(found) + ". Switch them off in the config.")
