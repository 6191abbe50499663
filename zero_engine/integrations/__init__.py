"""Integrations with other training frameworks. Each module here imports its framework, and
only here; the core package never imports this package."""
