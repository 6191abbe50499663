"""The engine's messages (logger ``zero_engine``): seen by default, the application's to route once
it configures logging.

Python shows a library's INFO records only if the application configured logging; a script
that never did (most training scripts) saw nothing of the engine's progress line, its
``stage: auto`` table or its notes (issue 65). So `show_by_default`, called by `initialize`,
gives the ``zero_engine`` logger a handler of its own that prints INFO and above on stdout
(where DeepSpeed prints its lines), as ``[zero_engine] message``, *while the application has
configured no logging*: a handler on the root logger or on ``zero_engine``, or a level set on
``zero_engine``. From the first record after the application configures logging, the handler
steps aside: the logger goes back to propagating at the level the application chose, and that
record goes to the application's handlers if their level lets it through.
"""

from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("zero_engine")


class _UntilConfigured(logging.Handler):
    """Prints the engine's records on stdout until the application configures logging."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("[zero_engine] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if application_configured():
            _step_aside()
            root = logging.getLogger()
            if record.levelno >= LOGGER.getEffectiveLevel() and record.levelno >= root.getEffectiveLevel():
                root.handle(record)
            return
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 (a closed stdout must not stop training)
            self.handleError(record)


_HANDLER = _UntilConfigured()


def application_configured() -> bool:
    """Whether the application set up logging: a handler on the root logger, or a handler or a
    level of its own on ``zero_engine``."""
    own = [handler for handler in LOGGER.handlers if handler is not _HANDLER]
    ours = _HANDLER in LOGGER.handlers
    return bool(logging.getLogger().handlers) or bool(own) or (not ours and LOGGER.level != logging.NOTSET)


def show_by_default() -> None:
    """If the application configured no logging, show the engine's INFO records on stdout."""
    if _HANDLER in LOGGER.handlers or application_configured():
        return
    LOGGER.addHandler(_HANDLER)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


def _step_aside() -> None:
    if _HANDLER in LOGGER.handlers:
        LOGGER.removeHandler(_HANDLER)
        LOGGER.setLevel(logging.NOTSET)
        LOGGER.propagate = True
