"""The NCCL model: a multi-rank CPU run whose hosts behave as on NCCL, recorded, and checked
for the dependency cycles that would hang GPUs.

On gloo a collective completes on its own and ``wait()`` blocks the host. On NCCL the host
runs ahead of the GPU: ``is_completed()`` is False long after a launch, ``wait()`` only makes
the *current stream* wait, and ProcessGroupNCCL makes its own stream wait for the current one
at every launch. So an order of calls that is fine on gloo can close a cycle on GPUs: rank A's
stream waits for a reduce-scatter that rank B launches only after B's stream passed a gather
that A queued behind that wait. Nothing on a CPU shows it; this model does, without GPUs.

`NcclModel`, entered on every rank around a run (after the process group exists), makes the
host behave as on NCCL and records, in host order, what the rank did:

- a data collective's launch (``launch``, its group and its number on that group), and each
  ``wait()`` on it (``swait``: the stream waits; the real wait is deferred to the next sync);
  ``is_completed()`` on it is False;
- a control round issued (``issue``) and read (``read``, or ``arrived`` when polled done): the
  control group is gloo on NCCL too, so its waits are real;
- host syncs of the compute stream (``sync``): the step's read-back
  (`zero_engine.devices.host_values`), `zero_engine.offload.wait_for_host_copies`, and copies
  between a device tensor and a host buffer that would not be pinned on a GPU (made by
  `zero_engine.offload.host_empty` without pinning): CUDA completes those before returning.
  Deferred waits run here for real;
- device-wide syncs (``device_sync``): a page-locked allocation once the run has started (the
  caller's first `mark`, after ``initialize``: CUDA lists ``cudaHostAlloc`` among the implicit
  synchronizations), ``torch.cuda.synchronize`` and ``torch.cuda.empty_cache``. They wait for
  every collective the rank launched, on every stream;
- point-to-point sends and receives (``batch_isend_irecv``, how the engine sends: the export's
  gather onto rank 0): each is a launch on the pair's own communicator (``p2p[src>dst]``,
  numbered per pair), complete once both ends launched it, so a send or receive without its
  match is a collective some member never launched;
- the side stream of hybrid second phases (``side_begin``, ``side_end``);
- the default group reports NCCL as the backend of the model's device (as
  ``init_process_group("cuda:nccl,cpu:gloo")`` does for CUDA), so the engine's own backend
  detection chooses the NCCL code paths (`Comm.orders_on_device`); its answer is a mark
  (``data backend nccl``); and freeing a stage 3 unit's storage, or an exchange's buffers,
  does nothing (gloo may still be writing into it).

`find_mismatches` lists the collectives NCCL would pair that differ (another operation or
size as some member's collective of the same number on one communicator). `find_hang` then
builds NCCL's dependency graph from every rank's trace and returns a cycle
(or a collective some member never launched) as a `Hang`, or None:

- a launch depends on the host reaching it, on every collective its stream waited for before
  it, and on the previous collective of its communicator (one communicator runs in order);
- a collective completes once every member launched it;
- a host sync depends on every collective the compute stream waited for, a device-wide sync on
  every collective the rank launched; a control round is read once every rank issued it.

Tests only: the values a modelled run computes are not meaningful (waits are deferred), unless
``real_waits`` makes every stream wait a real one: then the run takes NCCL's code paths with
values that mean what they would on GPUs.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from .. import devices, offload
from ..comm import connecting, groups, handles
from ..transforms import ulysses
from ..sharding.units import unit as unit_module

_DATA_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_to_all_single", "all_gather")
_FLAT_COLLECTIVES = ("_reduce_scatter_tensor", "_all_gather_into_tensor")


class Event(NamedTuple):
    """One thing a rank's host did, in order (see the module docstring for the kinds)."""

    kind: str
    group: str = ""
    seq: int = -1
    what: str = ""  # the collective, or the cause of a sync
    size: int = -1  # a launch: bytes of its largest tensor (the same on every member, as NCCL pairs them)
    # an all-to-all of pieces of any sizes: (elements received from, elements sent to) each
    # group rank; its buffers' sizes differ by rank, and rank i's sent[j] is rank j's received[i]
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None


class Hang(NamedTuple):
    """Why GPUs would hang: ``cycle``, each step waiting for the next (empty when the cause is
    a collective some member never launched, named in ``missing``), and each rank's first host
    event that would never complete."""

    cycle: list[str]
    missing: list[str]
    blocked: dict[int, str]

    def __str__(self) -> str:
        lines = ["NCCL dependency cycle (each waits for the next):", *[f"  {step}" for step in self.cycle]] if self.cycle else []
        lines += [f"never launched: {what}" for what in self.missing]
        lines += [f"rank {rank} blocks at {where}" for rank, where in sorted(self.blocked.items())]
        return "\n".join(lines)


class NcclModel:
    """``with NcclModel() as model: ...train...``, then ``model.events`` (see the module
    docstring). ``second_phase_on_compute_stream``: hybrid second phases wait for their first
    on the compute stream, as before the side stream (the N1 hang of the GPU review, for
    tests that plant it)."""

    def __init__(
        self, *, second_phase_on_compute_stream: bool = False, run_data_collectives: bool = True,
        real_waits: bool = False,
    ) -> None:
        self.events: list[Event] = []
        self.second_phase_on_compute_stream = second_phase_on_compute_stream
        # False: data collectives are recorded, not run (their outputs keep what they held), for
        # runs whose ranks pair different collectives (gloo would wait for its timeout); the
        # control rounds, and so the schedule, run as ever
        self.run_data_collectives = run_data_collectives
        # True: a stream wait also waits for real, so the run computes what it would on GPUs
        # (NCCL's code paths, meaningful values: a numerics check under NCCL's ordering); the
        # trace is still recorded, but the deferral a GPU's host runs ahead with is gone
        self.real_waits = real_waits
        self._started = False  # the caller's first mark: pinned allocations are device syncs from here
        self._seq: dict[str, int] = defaultdict(int)
        self._deferred: list[Any] = []  # real works whose wait a sync will do
        self._host_buffers: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> pinned on a GPU
        self._saved: list[tuple[Any, str, Any]] = []

    # -- what a run calls ----------------------------------------------------------------------

    def __enter__(self) -> NcclModel:
        for name in _DATA_COLLECTIVES:
            self._patch(dist, name, self._collective(name, getattr(dist, name)))
        for name in _FLAT_COLLECTIVES:
            self._patch(groups, name, self._collective(name.strip("_"), getattr(groups, name)))
        # NCCL for the device's tensors, as the group's configuration would say on a GPU: the
        # engine's own detection (`zero_engine.comm.connecting.device_backend`) must then take the NCCL paths.
        self._patch(dist, "get_backend_config", lambda group=None: "cpu:nccl,cuda:nccl")
        self._patch(connecting, "device_backend", self._device_backend(connecting.device_backend))
        self._patch(dist, "batch_isend_irecv", self._batch_isend_irecv(dist.batch_isend_irecv))
        self._patch(torch.cuda, "synchronize", lambda device=None: self._device_sync("torch.cuda.synchronize"))
        self._patch(torch.cuda, "empty_cache", lambda: self._device_sync("torch.cuda.empty_cache"))
        self._patch(handles, "second_phase_stream", self._second_phase_stream)
        self._patch(devices, "host_values", self._host_values(devices.host_values))
        self._patch(offload, "wait_for_host_copies", self._wait_for_host_copies)
        self._patch(offload, "host_empty", self._host_empty(offload.host_empty))
        self._patch(offload, "copy_to_host", self._copy_to_host(offload.copy_to_host))
        self._patch(offload, "copy_across", self._copy_across(offload.copy_across))
        self._patch(unit_module, "_free_storage", lambda tensor: None)
        self._patch(ulysses, "_free_storage", lambda tensor: None)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()
        self._run_deferred()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, value)

    def mark(self, what: str) -> None:
        """Put a label of the caller's into the trace (``forward``, ``step``: to say where
        recorded syncs happened); the analysis passes over it. The first one starts the run
        proper: a page-locked allocation after it is a device-wide sync."""
        self._started = True
        self._record("mark", what=what)

    # -- recording -----------------------------------------------------------------------------

    def _record(
        self, kind: str, group: str = "", seq: int = -1, what: str = "", size: int = -1,
        splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    ) -> None:
        self.events.append(Event(kind, group, seq, what, size, splits))

    def _next_seq(self, group: str) -> int:
        seq = self._seq[group]
        self._seq[group] += 1
        return seq

    def _collective(self, what: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any, group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
            name = group_name(group)
            seq = self._next_seq(name)
            if name.startswith("control"):  # gloo on NCCL too: real waits
                self._record("issue", name, seq, what)
                work = real(*args, group=group, async_op=async_op, **kwargs)
                if not async_op:
                    self._record("read", name, seq, what)
                    return work
                return _ControlWork(self, work, name, seq, what)
            splits = _splits(what, args, kwargs)
            size = -1 if splits is not None else _largest_bytes(args, kwargs)
            self._record("launch", name, seq, what, size, splits)
            launched = real(*args, group=group, async_op=True, **kwargs) if self.run_data_collectives else None
            work = _DataWork(self, launched, name, seq)
            if not async_op:
                work.wait()
                return None
            return work

        return collective

    def _stream_wait(self, work: _DataWork) -> None:
        self._record("swait", work.group, work.seq)
        if self.real_waits and work.real is not None:
            work.real.wait()
            return
        self._deferred.append(work.real)

    def _sync(self, what: str) -> None:
        self._record("sync", what=what)
        self._run_deferred()

    def _device_sync(self, what: str) -> None:
        self._record("device_sync", what=what)
        self._run_deferred()

    def _device_backend(self, real: Callable[..., str]) -> Callable[..., str]:
        """The engine's decision, recorded as a mark ("data backend nccl"): on this model's groups
        anything else is the engine missing NCCL (GPU review P1)."""

        def device_backend(device: torch.device, group: Any = None) -> str:
            backend = real(device, group)
            self._record("mark", what=f"data backend {backend}")
            return backend

        return device_backend

    def _batch_isend_irecv(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def batch_isend_irecv(ops: list[Any]) -> list[Any]:
            names = [self._p2p_launch(op.op.__name__, op.peer) for op in ops]
            works = real(ops) if self.run_data_collectives else [None] * len(ops)
            return [_DataWork(self, work, *name) for work, name in zip(works, names)]

        return batch_isend_irecv

    def _p2p_launch(self, kind: str, peer: int) -> tuple[str, int]:
        """A send or receive as a launch on the pair's communicator (``peer``: a global rank)."""
        me = dist.get_rank()
        src, dst = (me, peer) if kind.endswith("send") else (peer, me)
        name = f"p2p[{src}>{dst}]"
        seq = self._next_seq(name)
        self._record("launch", name, seq, kind.lstrip("i"))
        return name, seq

    def _run_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for work in deferred:
            if work is not None:  # None: not run (``run_data_collectives``)
                work.wait()

    @contextlib.contextmanager
    def _second_phase_stream(self, device: torch.device | None = None) -> Iterator[None]:
        if self.second_phase_on_compute_stream:
            yield
            return
        self._record("side_begin")
        try:
            yield
        finally:
            self._record("side_end")

    def _host_values(self, real: Callable[[torch.Tensor], list]) -> Callable[[torch.Tensor], list]:
        def host_values(tensor: torch.Tensor) -> list:
            self._sync("host_values")
            return real(tensor)

        return host_values

    def _wait_for_host_copies(self, device: torch.device) -> None:
        self._sync("wait_for_host_copies")

    def _host_empty(self, real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
            if pin and self._started:
                self._device_sync("pinned allocation")
            tensor = real(numel, dtype, pin)
            self._host_buffers[tensor.untyped_storage()] = pin
            return tensor

        return host_empty

    def _pageable(self, tensor: torch.Tensor) -> bool:
        return self._host_buffers.get(tensor.untyped_storage(), True) is False

    def _is_host_buffer(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage() in self._host_buffers

    def _copy_to_host(self, real: Callable[..., None]) -> Callable[..., None]:
        def copy_to_host(destination: torch.Tensor, values: torch.Tensor) -> None:
            if self._pageable(destination):
                self._sync("copy to pageable host memory")
            real(destination, values)

        return copy_to_host

    def _copy_across(self, real: Callable[..., None]) -> Callable[..., None]:
        def copy_across(destination: torch.Tensor, values: torch.Tensor) -> None:
            into_host, from_host = self._is_host_buffer(destination), self._is_host_buffer(values)
            if into_host != from_host and self._pageable(destination if into_host else values):
                self._sync("copy to pageable host memory" if into_host else "copy from pageable host memory")
            real(destination, values)

        return copy_across


def _splits(what: str, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """An all-to-all of pieces' (received, sent) element counts per group rank; None for any
    other collective, and for an all-to-all of equal pieces (its sizes pair as any collective's)."""
    if what != "all_to_all_single":
        return None
    named = ("output", "input", "output_split_sizes", "input_split_sizes")
    bound = {**dict(zip(named, args)), **kwargs}
    received, sent = bound.get("output_split_sizes"), bound.get("input_split_sizes")
    if received is None or sent is None:
        return None
    return tuple(received), tuple(sent)


def _largest_bytes(args: tuple, kwargs: dict[str, Any]) -> int:
    """Bytes of the largest tensor among a collective's arguments (lists of tensors included):
    the whole buffer of a flat collective, the largest piece of an all-gather into pieces."""
    found = [0]
    for value in [*args, *kwargs.values()]:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.Tensor):
                found.append(item.numel() * item.element_size())
    return max(found)


class _DataWork:
    """A data collective as NCCL's host sees it: never completed when polled; ``wait()`` orders
    the stream and returns."""

    def __init__(self, model: NcclModel, real: Any, group: str, seq: int) -> None:
        self.model, self.real, self.group, self.seq = model, real, group, seq

    def wait(self, timeout: Any = None) -> bool:
        self.model._stream_wait(self)
        return True

    def is_completed(self) -> bool:
        return False


class _ControlWork:
    """A control round: real waits, recorded as the host reading it."""

    def __init__(self, model: NcclModel, real: Any, group: str, seq: int, what: str) -> None:
        self.model, self.real, self.group, self.seq, self.what = model, real, group, seq, what

    def wait(self, timeout: Any = None) -> bool:
        self.real.wait()
        self.model._record("read", self.group, self.seq, self.what)
        return True

    def is_completed(self) -> bool:
        done = self.real.is_completed()
        if done:
            self.model._record("arrived", self.group, self.seq, self.what)
        return done


def group_name(group: Any) -> str:
    """A process group as traces name it: its role and ranks among the engine's own groups
    (`zero_engine.comm`), ``world`` for the default group."""
    if group is None or group is dist.group.WORLD:
        return "world"
    for (_, _, role, members), own in groups._OWN_GROUPS.items():
        if own is group:
            return f"{role}{list(members) if members else '[all]'}"
    return f"group{dist.get_process_group_ranks(group)}"


# -- the analysis ------------------------------------------------------------------------------


def find_hang(traces: Sequence[Sequence[Event]]) -> Hang | None:
    """The hang NCCL would meet on these traces (one per rank, in rank order), or None."""
    deps: dict[tuple, set[tuple]] = defaultdict(set)
    members: dict[str, set[int]] = defaultdict(set)
    labels: dict[tuple, str] = {}
    for rank, trace in enumerate(traces):
        for event in trace:
            if event.group:
                members[event.group].add(rank)
    for rank, trace in enumerate(traces):
        compute: dict[str, int] = {}  # group -> the last collective the compute stream waited for
        side: dict[str, int] = {}
        launched: set[tuple] = set()  # every collective this rank launched so far
        in_side = False
        for index, event in enumerate(trace):
            host = ("H", rank, index)
            labels[host] = f"rank {rank}'s host at event {index}: {describe(event)}"
            deps[host]  # every host event is a node
            if index:
                deps[host].add(("H", rank, index - 1))
            stream = side if in_side else compute
            if event.kind == "launch":
                start = ("S", rank, event.group, event.seq)
                labels[start] = f"rank {rank} starts {event.what} {event.group}#{event.seq}"
                done = ("D", event.group, event.seq)
                labels.setdefault(done, f"{event.what} {event.group}#{event.seq} completes")
                deps[start] |= {host, *_done(stream)}
                if event.seq:
                    deps[start].add(("D", event.group, event.seq - 1))
                deps[done] |= {("S", member, event.group, event.seq) for member in members[event.group]}
                launched.add(done)
            elif event.kind == "swait":
                stream[event.group] = max(stream.get(event.group, -1), event.seq)
            elif event.kind == "sync":
                deps[host] |= _done(compute)
            elif event.kind == "device_sync":
                deps[host] |= launched
            elif event.kind == "issue":
                arrived = ("R", event.group, event.seq)
                labels[arrived] = f"round {event.group}#{event.seq} reaches every rank"
                deps[arrived].add(host)
            elif event.kind in ("read", "arrived"):
                deps[host].add(("R", event.group, event.seq))
            elif event.kind == "side_begin":
                in_side = True
                _merge(side, compute)  # the side stream first waits for the compute stream
            elif event.kind == "side_end":
                in_side = False
    return _stuck(deps, labels, len(traces))


def find_mismatches(traces: Sequence[Sequence[Event]]) -> list[str]:
    """Collectives that NCCL would pair although they differ: the k-th launch of a
    communicator must be the same operation on tensors of the same size on every member
    (`find_hang` pairs by number alone; an all-gather paired with an all-reduce of another
    size is undefined behaviour on NCCL, a hang or garbage). Point-to-point pairs (a send and
    its receive) are exempt. An all-to-all of pieces pairs each rank's sends with the
    receivers' counts instead: rank i's ``sent[j]`` must be rank j's ``received[i]`` (the group
    ranks are the members in rank order)."""
    seen: dict[tuple[str, int], dict[int, tuple[str, int]]] = defaultdict(dict)
    pieces: dict[tuple[str, int], dict[int, tuple[tuple[int, ...], tuple[int, ...]]]] = defaultdict(dict)
    for rank, trace in enumerate(traces):
        for event in trace:
            if event.kind == "launch" and not event.group.startswith("p2p"):
                seen[(event.group, event.seq)][rank] = (event.what, event.size)
                if event.splits is not None:
                    pieces[(event.group, event.seq)][rank] = event.splits
    found = []
    for (group, seq), by_rank in sorted(seen.items()):
        if len(set(by_rank.values())) > 1:
            launched = ", ".join(
                f"rank {rank} {what} of {size} bytes" for rank, (what, size) in sorted(by_rank.items())
            )
            found.append(f"{group}#{seq}: {launched}")
        elif (group, seq) in pieces:
            found.extend(f"{group}#{seq}: {unpaired}" for unpaired in _unpaired_pieces(pieces[(group, seq)]))
    return found


def _unpaired_pieces(by_rank: dict[int, tuple[tuple[int, ...], tuple[int, ...]]]) -> list[str]:
    """An all-to-all of pieces' sends that their receivers do not expect in that size."""
    members = sorted(by_rank)
    found = []
    for i, sender in enumerate(members):
        for j, receiver in enumerate(members):
            sent, expected = by_rank[sender][1][j], by_rank[receiver][0][i]
            if sent != expected:
                found.append(f"rank {sender} sends {sent} elements to rank {receiver}, which expects {expected}")
    return found


def _done(stream: dict[str, int]) -> set[tuple]:
    return {("D", group, seq) for group, seq in stream.items()}


def _merge(into: dict[str, int], other: dict[str, int]) -> None:
    for group, seq in other.items():
        into[group] = max(into.get(group, -1), seq)


def _stuck(deps: dict[tuple, set[tuple]], labels: dict[tuple, str], ranks: int) -> Hang | None:
    """Kahn's algorithm over the graph; a node never reached lies on a cycle, behind one, or
    behind a launch that never happened (a start node nobody recorded)."""
    nodes = set(deps) | {dep for node_deps in deps.values() for dep in node_deps}
    never = {node for node in nodes if node[0] == "S" and node not in deps}
    waiting = {node: len(deps.get(node, ())) for node in nodes}
    users: dict[tuple, list[tuple]] = defaultdict(list)
    for node, node_deps in deps.items():
        for dep in node_deps:
            users[dep].append(node)
    ready = deque(node for node, count in waiting.items() if count == 0 and node not in never)
    reached: set[tuple] = set()
    while ready:
        node = ready.popleft()
        reached.add(node)
        for user in users[node]:
            waiting[user] -= 1
            if waiting[user] == 0:
                ready.append(user)
    stuck = nodes - reached
    if not stuck:
        return None
    blocked = {}
    for node in sorted((node for node in stuck if node[0] == "H"), key=lambda node: node[2]):
        blocked.setdefault(node[1], labels[node])
    missing = [f"rank {node[1]} never starts {node[2]}#{node[3]}" for node in sorted(never)]
    return Hang(_a_cycle(stuck, deps, labels), missing, blocked)


def _a_cycle(stuck: set[tuple], deps: dict[tuple, set[tuple]], labels: dict[tuple, str]) -> list[str]:
    """One cycle among the stuck nodes, as labels (empty if they only wait for a missing launch)."""
    for start in sorted(stuck, key=repr):
        path: list[tuple] = []
        on_path: dict[tuple, int] = {}
        node: tuple | None = start
        while node is not None and node not in on_path:
            on_path[node] = len(path)
            path.append(node)
            node = next((dep for dep in sorted(deps.get(node, ()), key=repr) if dep in stuck), None)
        if node is not None:
            kept: list[tuple] = []
            for step in path[on_path[node]:]:  # a run of one host's events is told by its latest
                if not (step[0] == "H" and kept and kept[-1][0] == "H" and kept[-1][1] == step[1]):
                    kept.append(step)
            return [labels.get(step, repr(step)) for step in kept]
    return []


def describe(event: Event) -> str:
    if event.kind == "sync":
        return f"host sync ({event.what})"
    if event.kind == "device_sync":
        return f"device-wide sync ({event.what})"
    if event.kind == "mark":
        return f"mark {event.what!r}"
    if event.kind in ("side_begin", "side_end"):
        return "enters the side stream" if event.kind == "side_begin" else "leaves the side stream"
    names = {"launch": "launches", "swait": "stream-waits for", "issue": "issues round",
             "read": "reads round", "arrived": "sees round arrived"}
    what = f" {event.what}" if event.what else ""
    return f"{names[event.kind]}{what} {event.group}#{event.seq}"


def opposite_orders(traces: Sequence[Sequence[Event]], first: str, second: str) -> int:
    """Pairs of launches, one on a group named starting with ``first`` and one with ``second``,
    that two ranks sharing both groups launched in opposite orders (NCCL's guidance for
    several communicators: the same order on every rank)."""
    positions = []
    for trace in traces:
        order = [(event.group, event.seq) for event in trace if event.kind == "launch"]
        positions.append({key: place for place, key in enumerate(order)})
    count = 0
    for a in range(len(traces)):
        for b in range(a + 1, len(traces)):
            shared = [key for key in positions[a] if key in positions[b]]
            ones = [key for key in shared if key[0].startswith(first)]
            others = [key for key in shared if key[0].startswith(second)]
            for x in ones:
                for y in others:
                    if (positions[a][x] < positions[a][y]) != (positions[b][x] < positions[b][y]):
                        count += 1
    return count
