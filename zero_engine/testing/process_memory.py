"""Memory as the process holds it, for tests and benchmarks: never the engine counting itself.

The engine's `memory_report()` adds up the tensors it believes it holds; what a process really
holds also includes what autograd saved for backward, allocator slack and library code. These
probes read the truth:

- `resident_bytes` / `peak_resident_bytes` / `reset_peak_resident`: the resident set and its
  high-water mark (``VmHWM``) from ``/proc`` (Linux); `data_bytes`, what ``RLIMIT_DATA``
  caps. Freed large tensors leave the resident set only when glibc returns them to the
  kernel: run with ``MALLOC_MMAP_THRESHOLD_=65536`` (set before the process starts), or call
  `map_large_allocations` in one already started, so that every tensor above the threshold is
  its own mapping.
- `SavedTensorMeter`: the bytes held by the storages of every tensor autograd saved in a
  block of code, read when asked, so storage freed after saving counts as freed. It sees
  exactly what a forward keeps alive for its backward, with no allocator noise.
- `live_tensor_bytes`: the bytes of every distinct storage behind the tensor objects alive in
  the process (found by the garbage collector, not by asking the engine), exact where the
  resident set is blurred by the allocator.
- `cuda_max_allocated_bytes` / `reset_cuda_peak`: the CUDA caching allocator's peak (CUDA only).
"""

from __future__ import annotations

import gc
import os
from types import TracebackType
from typing import Any

import torch

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """The process's resident set now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE_BYTES


def peak_resident_bytes() -> int:
    """The resident set's high-water mark since the process started or `reset_peak_resident`."""
    return _status_bytes("VmHWM")


def data_bytes() -> int:
    """The process's private writable address space (``VmData``: heap, anonymous maps, thread
    stacks, touched or not): what ``RLIMIT_DATA`` caps."""
    return _status_bytes("VmData")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def map_large_allocations(nbytes: int) -> None:
    """From now on, every allocation of ``nbytes`` or more is a mapping of its own, unmapped when
    freed (glibc's ``M_MMAP_THRESHOLD``, fixed): what ``MALLOC_MMAP_THRESHOLD_`` does, for a
    process already started (ranks forked from a test's server). Without it glibc raises its
    threshold after the first large free, and its heap keeps what was freed in the resident set."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # M_MMAP_THRESHOLD


def reset_peak_resident() -> None:
    """Start a new high-water mark at the current resident set (Linux 4.0 and later)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


class SavedTensorMeter:
    """Counts the storage bytes behind the tensors autograd saves inside ``with``.

    The hooks pass every tensor through unchanged and keep its storage object, so `bytes_held`
    reads each storage's size when called: a weight whose storage the engine freed after its
    forward counts 0, while a weight kept alive by autograd counts in full.
    """

    def __init__(self) -> None:
        self._storages: dict[int, Any] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self._storages.setdefault(storage._cdata, storage)
        return tensor

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._hooks.__exit__(kind, error, tb)

    def bytes_held(self) -> int:
        return sum(storage.nbytes() for storage in self._storages.values())


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def live_tensor_bytes(device: torch.device | None = None) -> int:
    """Bytes of the distinct storages behind every live tensor object (on ``device`` only, if
    given), each storage counted once however many views share it. Tensors held only inside
    C++ (autograd's saved tensors: `SavedTensorMeter`) are not seen."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which some objects make a warning
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta and (device is None or obj.device == device):
            storage = obj.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(storages.values())


def cuda_max_allocated_bytes(device: torch.device) -> int:
    """CUDA only: the caching allocator's peak of allocated bytes on ``device``."""
    return torch.cuda.max_memory_allocated(device)


def reset_cuda_peak(device: torch.device) -> None:
    """CUDA only: start a new allocated-bytes peak on ``device``."""
    torch.cuda.reset_peak_memory_stats(device)


def allocated_during(run: Any, mark: str) -> tuple[int, int]:
    """Bytes allocated and not freed when ``mark`` is recorded (``torch.profiler.record_function``),
    and at most, while ``run`` runs: from the profiler's memory records, the CPU allocator's own
    count of every allocation and free, in order."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # a collection inside would free earlier tensors, whose frees the profiler may count
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
    finally:
        gc.enable()
    events = list(prof.profiler.kineto_results.events())
    marked = min(event.start_ns() for event in events if event.name() == mark)
    records = sorted((event.start_ns(), event.nbytes()) for event in events if event.name() == "[memory]")
    alive = peak = 0
    at_mark = None
    for when, nbytes in records:
        if at_mark is None and when >= marked:
            at_mark = alive
        alive += nbytes
        peak = max(peak, alive)
    return (alive if at_mark is None else at_mark), peak


def step_allocations(engine: Any, ids: torch.Tensor) -> tuple[int, int]:
    """`allocated_during` a training step's forward and backward of a causal language model on
    ``ids`` (labels the ids: ``engine(input_ids=ids, labels=ids).loss``), after two steps in
    which buffers, optimizer state and allocator caches settle; the mark: the forward's end."""
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    def forward_backward() -> None:
        out = engine(input_ids=ids, labels=ids)
        with torch.profiler.record_function("forward done"):
            pass
        engine.backward(out.loss)
        del out

    return allocated_during(forward_backward, "forward done")


def step_resident_growth(engine: Any, ids: torch.Tensor, steps: int = 3) -> int:
    """How far a training step (forward, backward, optimizer step) of a causal language model on
    ``ids`` raises the process's resident high-water mark above the resident set it starts
    from, after two warm-up steps: the least of ``steps`` steps (a reading can only be raised by
    noise). Meaningful where freed large tensors leave the resident set (`map_large_allocations`)."""
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    growth = []
    for _ in range(steps):
        gc.collect()
        start = resident_bytes()
        reset_peak_resident()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        growth.append(peak_resident_bytes() - start)
    return min(growth)
