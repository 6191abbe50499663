"""A directory on a disk for swap files (`check_swap_directory` refuses tmpfs, and /tmp may be
tmpfs): /var/tmp, the temporary directory, or this checkout, the first writable one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _a_disk() -> str:
    from zero_engine.sharding.tiers.nvme import MEMORY_FILESYSTEMS, filesystem_of

    for candidate in ("/var/tmp", tempfile.gettempdir(), str(Path(__file__).resolve().parent)):
        if os.path.isdir(candidate) and os.access(candidate, os.W_OK) and \
                filesystem_of(Path(candidate)) not in MEMORY_FILESYSTEMS:
            return candidate
    raise RuntimeError("no writable directory on a disk for the swap files")


DISK = _a_disk()
