"""DeepSpeed's checkpoint files, read without running code from them and without DeepSpeed.

DeepSpeed pickles a few of its own classes into its optimizer files (its loss scalers, the
ZeRO stage enum, the ``fragment_address`` of each parameter's slice), so
``torch.load(weights_only=True)`` refuses them, and ``weights_only=False`` would run whatever
a file names. Here the files go through torch's restricted unpickler (tensors, plain
containers, dtypes) with stand-ins for exactly those classes, by their full names: each becomes
a plain value (a dict of the object's attributes, or the enum's int). Any other class is
refused with an error naming the file and the class; nothing else is ever imported or called.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError


class _Attributes(dict):
    """An object DeepSpeed pickled, as the dict of its attributes (built, never called)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"unexpected state of a {type(self).__qualname__}: {type(state).__name__}")
        self.update(state)


class _EnumValue(int):
    """An ``IntEnum`` member, as its int (pickled as a call of the enum with its value)."""


def _stand_in(base: type, full_name: str) -> type:
    module, _, name = full_name.rpartition(".")
    return type(name, (base,), {"__module__": module, "__qualname__": name})


# DeepSpeed 0.19's classes in checkpoint files, by the names the files give them.
STAND_INS = [
    _stand_in(_Attributes, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    _stand_in(_Attributes, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    _stand_in(_Attributes, "deepspeed.utils.tensor_fragment.fragment_address"),
    _stand_in(_EnumValue, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]

_UNSUPPORTED = re.compile(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)")


def read_deepspeed_file(path: Path) -> Any:
    """One DeepSpeed ``.pt`` file (memory-mapped), its DeepSpeed objects as plain values.
    Refusals and damage raise `CheckpointError` naming the file (and the class)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a DeepSpeed checkpoint needs every rank's file)")
    try:
        with _allowing(STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        found = _UNSUPPORTED.search(str(err))
        named = f"the class {found.group(1)}" if found else "an object"
        raise CheckpointError(
            f"{path}: refused: it names {named}, which is not a tensor, a plain container or one of "
            f"DeepSpeed's checkpoint classes ({', '.join(f'{c.__module__}.{c.__qualname__}' for c in STAND_INS)}); "
            "nothing from it was run"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(f"{path}: unreadable, truncated or not a torch file ({str(err).splitlines()[0]})") from None


@contextlib.contextmanager
def _allowing(classes: list[type]) -> Iterator[None]:
    """torch's restricted unpickler accepting ``classes`` too, for this load only where torch
    can scope it (``safe_globals``, torch 2.5 and later)."""
    scoped = getattr(torch.serialization, "safe_globals", None)
    if scoped is not None:
        with scoped(classes):
            yield
    else:
        torch.serialization.add_safe_globals(classes)
        yield
