"""Deprecated home of the refusals of unbuilt features: each section declares its own now
(``REFUSED`` beside its fields, gathered by `zero_engine.config.refusals`)."""

from __future__ import annotations

from .config.refusals import refuse as refuse_unbuilt_features
from .config.refusals import refused_settings as unbuilt_features

__all__ = ["refuse_unbuilt_features", "unbuilt_features"]
