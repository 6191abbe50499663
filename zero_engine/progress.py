"""The progress line rank 0 prints every ``steps_per_print`` optimizer steps, as DeepSpeed prints
its own, with what users look for in it:

    [zero_engine] step 20 | loss 2.3412 | lr 3.00e-04 | grad norm 0.812 | loss scale 65536 |
    skipped 0 | 31.2 samples/s | 3,994 tokens/s | forward 41.3 ms | backward 88.0 ms | step 12.1 ms

- loss: rank 0's mean over the micro-steps since the last line, as given to ``engine.backward``
  (summed on the device, read back once per line, never in between); "—" where the backward
  was a plain ``loss.backward()``;
- throughput: the samples of the optimizer steps since the last line (``train_batch_size``
  each), and the tokens when the model's inputs say (``input_ids``, or a first integer argument
  of two or more dimensions: rank 0's count times the data-parallel ranks), per wall second;
- ``wall_clock_breakdown: true``: the mean forward, backward and step times over the same
  steps (on a GPU the device is synchronized around each timed phase, as DeepSpeed's timers do,
  so turn it on to look, not to train fast).

The loss scale shows under fp16 only. Where it goes: the logger ``zero_engine``
(`zero_engine.logs`: on stdout while the application configured no logging).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

PHASES = ("forward", "backward", "step")


class Progress:
    """Rank 0's progress line (nothing to do elsewhere, or without ``steps_per_print``)."""

    def __init__(self, every: int | None, breakdown: bool, train_batch_size: int, data_ranks: int,
                 device: torch.device, printing: bool) -> None:
        self.every = every if printing else None
        self.breakdown = breakdown and self.every is not None
        self.train_batch_size, self.data_ranks, self.device = train_batch_size, data_ranks, device
        self._since = time.perf_counter()
        self._steps = 0
        self._tokens = 0
        self._loss: torch.Tensor | None = None
        self._losses = 0
        self._seconds = dict.fromkeys(PHASES, 0.0)

    def add_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.every is None:
            return
        ids = kwargs.get("input_ids")
        if ids is None and args and torch.is_tensor(args[0]) and not args[0].is_floating_point() and args[0].dim() >= 2:
            ids = args[0]
        if torch.is_tensor(ids):
            self._tokens += ids.numel()

    def add_loss(self, loss: torch.Tensor) -> None:
        """Summed on the device (no host sync): read back once, for the next line."""
        if self.every is not None:
            value = loss.detach().float().reshape(())
            self._loss = value if self._loss is None else self._loss + value
            self._losses += 1

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Time ``phase`` (with ``wall_clock_breakdown``), the device synchronized around it."""
        if not self.breakdown:
            yield
            return
        _synchronize(self.device)
        started = time.perf_counter()
        try:
            yield
        finally:
            _synchronize(self.device)
            self._seconds[phase] += time.perf_counter() - started

    def after_step(self, global_step: int, lrs: list[float], grad_norm: float | None, loss_scale: float | None,
                   skipped: int) -> str | None:
        """The line to print after optimizer step ``global_step`` (counted from 1), or None."""
        if self.every is None:
            return None
        self._steps += 1
        if global_step % self.every:
            return None
        elapsed = max(time.perf_counter() - self._since, 1e-9)
        parts = [f"step {global_step}"]
        parts.append(f"loss {self._loss.item() / self._losses:.4f}" if self._loss is not None else "loss —")
        parts.append("lr " + ", ".join(f"{lr:.2e}" for lr in lrs))
        parts.append(f"grad norm {grad_norm:.4g}" if grad_norm is not None else "grad norm —")
        if loss_scale is not None:
            parts.append(f"loss scale {loss_scale:g}")
        parts.append(f"skipped {skipped}")
        parts.append(f"{self._steps * self.train_batch_size / elapsed:.1f} samples/s")
        if self._tokens:
            parts.append(f"{self._tokens * self.data_ranks / elapsed:,.0f} tokens/s")
        if self.breakdown:
            parts += [f"{phase} {1000 * seconds / self._steps:.1f} ms" for phase, seconds in self._seconds.items()]
        self._since, self._steps, self._tokens = time.perf_counter(), 0, 0
        self._loss, self._losses = None, 0
        self._seconds = dict.fromkeys(PHASES, 0.0)
        return " | ".join(parts)


def _synchronize(device: torch.device) -> None:
    """CUDA only: wait for the device, so a phase's time is its kernels' (DeepSpeed's timers too)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
