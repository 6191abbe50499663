"""What a feature holds beside the units' state (NVMe offload's swap spaces: a file, threads,
host buffers), registered with the build as it is opened (`Holdings.add`), so that the loop,
the step and the reports iterate one list instead of naming each feature.

A held resource (`Held`) says how it is counted (its host bytes, its line in ``comm_report()``),
how long it reads ahead of the step, what its failure is and how the ranks raise it, and how it
is let go. A failure is local (a disk on one rank): the rank goes on to the next agreement (the
step's norm reduction, stage 3's rounds), which carries "this rank's resources failed" to every
rank, and every rank raises the resource's error there (`Holdings.agreed_error`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol


class Held(Protocol):
    """One resource a feature opened for this rank."""

    kind: str  # its line in comm_report() (resources of one kind are summed)
    what: str  # what fails, for the ranks' message ("NVMe offload: a swap file's read or write")
    consequence: str  # what the user does after its failure
    step_read_ahead: int  # units its step reads ahead during the last pass (0: none)

    @property
    def host_bytes(self) -> int:
        """Host memory it holds beside the units' state (buffers), counted in memory_report's host."""
        ...

    def failure(self) -> OSError | None:
        """Its first failure on this rank, on any thread (None while everything went through)."""
        ...

    def error(self, message: str) -> Exception:
        """The exception every rank raises for an agreed failure."""
        ...

    def report(self) -> dict[str, int]:
        """What it moved since the last `reset_report` (bytes by direction)."""
        ...

    def reset_report(self) -> None: ...

    def close(self) -> None: ...


class Holdings:
    """The resources this rank's build opened, in order."""

    def __init__(self) -> None:
        self.items: list[Held] = []

    def add(self, item: Held) -> Held:
        self.items.append(item)
        return item

    def __iter__(self) -> Iterator[Held]:
        return iter(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def host_bytes(self) -> int:
        return sum(item.host_bytes for item in self.items)

    @property
    def step_read_ahead(self) -> int:
        return max((item.step_read_ahead for item in self.items), default=0)

    def failure(self) -> OSError | None:
        return next((failure for item in self.items if (failure := item.failure()) is not None), None)

    def reports(self) -> dict[str, dict[str, float]]:
        """Each kind's bytes moved, summed; written bytes also as terabytes per 1,000 such steps
        (what wears an SSD)."""
        found: dict[str, dict[str, float]] = {}
        for item in self.items:
            line = found.setdefault(item.kind, {})
            for key, value in item.report().items():
                line[key] = line.get(key, 0) + value
        for line in found.values():
            if "written" in line:
                line["tb_written_per_1000_steps"] = line["written"] * 1000 / 1e12
        return found

    def reset_reports(self) -> None:
        for item in self.items:
            item.reset_report()

    def close(self) -> None:
        for item in self.items:
            item.close()

    def failure_message(self, ranks: str, where: str) -> str:
        """What every rank says once the ranks agreed that ``ranks`` (in words) failed
        ``where``: this rank's own failure named, or that its resources went through."""
        failed = self._failed_or_first()
        mine = self.failure()
        here = f"this rank's: {mine}" if mine is not None else "this rank's went through"
        return f"{failed.what} failed on {ranks}{where}; {here}. {failed.consequence}"

    def agreed_error(self, message: str) -> Exception:
        """The failed resource's error (this rank's first, else the first held) with
        ``message``, caused by this rank's own failure if any: to raise on every rank."""
        error = self._failed_or_first().error(message)
        error.__cause__ = self.failure()
        return error

    def _failed_or_first(self) -> Held:
        return next((item for item in self.items if item.failure() is not None), self.items[0])
