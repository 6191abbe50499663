"""Stage 3: gather each unit's parameters around the modules that use them, free them after.

Forward: a unit module's pre-hook gathers the units it needs (counted, so nested and tied
uses share one gather) and starts the all-gather of the next unit in the order recorded by
the previous forward; its post-hook releases them, and a unit nobody holds is freed. A sharded
parameter read during a forward while no hook holds its unit (a head's ``F.linear(h,
self.embed.weight)``, the members of a container whose own forward never runs) gathers its
unit where it is read (`zero_engine.sharding.param_access`): the unit joins what the module
running then needs, in this forward (until that module's forward ends) and in every later
forward and backward, as DeepSpeed registers an external parameter. The
post-hook also puts a hook on the module's output tensors: the first gradient that reaches
one of them, at the start of the module's backward, gathers its units again (and prefetches
the next in reverse forward order). A unit is freed in backward once all of its parameters
have received their gradient (the reducer says so): every operation that needed its values
has then run. A frozen unit (`FrozenUnit`) gets no gradient: it is freed by a post-backward
signal instead, an identity autograd function over the module's inputs (as FSDP2's
``RegisterPostBackwardFunction``), whose backward runs once the gradients of those inputs are
computed, after every operation of that call of the module; its gathers count per call, so a
module called twice keeps its frozen units until both calls' backwards are done. Whatever is
still gathered when backward returns (unused parameters, a call whose inputs needed no
gradient) is freed.

Every gather is agreed on first, and launched in the order `CollectiveSchedule` derives from
what every rank asked for (`zero_engine.sharding.agreement`), with the reductions of the
gradients: ranks that run different modules (a mixture of experts, a data-dependent branch)
take part in each other's gathers instead of hanging, aborting in the transport on mismatched
sizes or filling one unit with another's values. Agreeing synchronously before every gather
stalls every rank at every gather (about 8% of a step here, see ``docs/benchmarks.md``), so
gathers are proposed ahead, a *window* of the recorded order at a time (up to
`WANTS_PER_ROW` units in one round): at the end of a pass for the next one's first units, and
when a prefetch reaches the end of what is agreed. The agreement completes in the background
and the prefetches launch without waiting. A proposal that turns out wrong costs a wasted
gather, never a wrong one.

Prefetching launches one unit ahead, bounded by ``stage3_prefetch_bucket_size`` (a larger unit
is not prefetched; a window holds at most this many elements) and
``stage3_max_live_parameters`` (no prefetch or window that would exceed it).

The root unit stays gathered from the end of a forward that a backward follows to its backward
(as FSDP2 keeps its root): that backward starts with it, and it is held through the forward
anyway, so this saves a gather and costs no memory at any peak.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm import Comm
from ..errors import DivergedRanksError, ShardedParameterError
from ..tree import iter_tensors
from .lifecycle import Lifecycle, TrainingState
from .param_access import ReadWatch, unserved_reads, watch_reads
from .reducer import GradReducer
from .agreement import WANTS_PER_ROW, CollectiveSchedule, PassKind
from .frozen_unit import FrozenUnit
from .unit import FlatUnit, ShardedFlatUnit

logger = logging.getLogger("zero_engine")


class NoGather:
    """Stages 0-2: parameters are always whole; nothing to gather."""

    def begin_backward(self) -> None: ...

    def end_backward(self) -> None: ...

    def unit_complete(self, unit: FlatUnit) -> None: ...

    def attach_reducer(self, reducer: GradReducer) -> None: ...

    def may_wait_for_reduction(self, index: int) -> bool:
        """Stages 0-2: always (see `ParamGatherer.may_wait_for_reduction`)."""
        return True

    def remove_hooks(self) -> None: ...

    def explain_failed_forward(self, error: BaseException) -> str | None:
        """Stage 3: why a forward failed, when it used a sharded parameter the engine did not
        gather; nothing to say below stage 3."""
        return None

    def peaks(self) -> tuple[int, int]:
        return 0, 0

    @property
    def root_units(self) -> tuple[int, ...]:
        """The units of the root module's own parameters (kept gathered from a forward into its
        backward at stage 3)."""
        return ()


class ParamGatherer(NoGather):
    """Gathers and frees `ShardedFlatUnit` s around the forward and backward of their modules."""

    def __init__(
        self,
        root: nn.Module,
        units: Sequence[ShardedFlatUnit | FrozenUnit],
        hooked: Sequence[tuple[nn.Module, tuple[int, ...]]],
        comm: Comm,
        prefetch_numel: int,
        max_live_numel: int,
        lifecycle: Lifecycle,
    ) -> None:
        self.comm = comm
        self.units = list(units)
        self.lifecycle = lifecycle  # tracks the root's forward (its hooks run before these)
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self._index = {id(unit): index for index, unit in enumerate(self.units)}
        self._holds = [_Holds() for _ in self.units]
        self.schedule = CollectiveSchedule(
            comm, self._launch_gather, lambda index: self.units[index].has_full_storage, self._describe
        )
        self.reducer: GradReducer | None = None
        self._served: set[int] = set()  # gathered only because other ranks wanted them
        # Units whose modules ran in a forward since the last backward ended: only these can
        # get gradients in the backwards that follow (several may, of forwards run before them).
        self._ran: set[int] = set()
        self._backward_ended = False
        self._order: list[int] = []  # this forward's units, in first-use order
        self._recorded: list[int] = []  # the last complete forward's order, for prefetching
        self.peak_forward_bytes = 0
        self.peak_backward_bytes = 0
        # What each hooked module needs gathered while it runs (a read served outside the hooks
        # adds to it), the root always among them; the hooked modules running, innermost last.
        self._needs: dict[nn.Module, tuple[int, ...]] = {root: ()}
        self._needs.update(hooked)
        self._running: list[nn.Module] = []
        self._calls: list[_Call] = []  # the calls of the hooked modules running, as `_running`
        self._root = root
        self._forward_thread = threading.get_ident()
        self._unit_of = {param: index for index, unit in enumerate(self.units) for param in unit.params}
        self._read_watch = ReadWatch(self._on_read)
        self._unwatch = watch_reads(
            [module for module in root.modules() if any(p in self._unit_of for p in module._parameters.values())],
            self._read_watch,
        )
        # The root's outer hooks bracket every forward, whoever calls the model: registered
        # first (pre) and last (post), so they run around the unit hooks of the root itself.
        self._handles = [root.register_forward_pre_hook(self._enter_root)]
        for module in self._needs:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_forward, always_call=True))
        self._handles.append(root.register_forward_hook(self._exit_root, always_call=True))

    @property
    def root_units(self) -> tuple[int, ...]:
        return self._needs[self._root]

    # -- a whole forward ---------------------------------------------------------------------

    def attach_reducer(self, reducer: GradReducer) -> None:
        """The rows report how many of ``reducer``'s reductions were launched; units whose
        modules did not run are settled with it at the start of each backward."""
        self.reducer = reducer
        self.schedule.reductions = reducer

    def may_wait_for_reduction(self, index: int) -> bool | None:
        """Whether every rank has launched the reduction of the reducer's unit ``index`` (said
        so in its rows), so that waiting for it cannot wait for a rank that is waiting for
        this one; None while rounds that may say so are in flight (see
        `CollectiveSchedule.launched_everywhere`)."""
        if self._diverged:
            return False
        return self.schedule.launched_everywhere(index)

    @property
    def _diverged(self) -> bool:
        return bool(self.schedule.divergence)

    def check_usable(self) -> None:
        """After a divergence the ranks have launched different numbers of gathers, so no later
        collective of this engine can pair up: every call raises at once, on every rank,
        instead of issuing one (on NCCL an unmatched kernel would spin until the watchdog)."""
        if self._diverged:
            raise DivergedRanksError(f"{self.schedule.divergence} (raised earlier; this engine cannot go on)")

    def settle_for_call(self) -> None:
        """After a collective call's row (`zero_engine.sharding.calls.PassCallGuard`): every unit
        sharded for the call (a load writes shards)."""
        self._release_kept()  # a backward that follows gathers the root again
        # It launched the gathers agreed before (prefetches proposed for the next pass): let
        # them complete and free them, so that every unit is sharded for the call (a load
        # writes shards) and no buffer is abandoned to a collective in flight.
        self._free_unheld(wait=True)

    def _enter_root(self, module: nn.Module, args: Any) -> None:
        self.check_usable()
        if self.lifecycle.forward_depth == 1:  # the outermost call
            if any(unit.has_full_storage for unit in self.units):
                self._release_all()  # a backward raised half-way, or no backward came
            self._forward_thread = threading.get_ident()
            self._read_watch.active = True
            self.schedule.begin_pass(PassKind.FORWARD)
            if self._backward_ended:
                self._ran, self._backward_ended = set(), False
            self._order = []
            self.peak_forward_bytes = self._live_bytes()

    def _exit_root(self, module: nn.Module, args: Any, output: Any) -> None:
        """Runs even when the forward raised (``always_call``): every unit hook has released
        its units by then, so a failed forward leaves nothing gathered."""
        if self.lifecycle.forward_depth == 0:
            self._read_watch.active = False
            if self._order:
                self._recorded = self._order
            backward_follows = any(t.requires_grad for t in iter_tensors(output))
            if backward_follows:  # the root's units still gathered are kept for the backward, which starts with them
                for index in self.root_units:
                    self._holds[index].backward = self.units[index].has_full_storage
            self._end_pass()  # frees what nobody holds (the root's units too, when no backward follows)
            self._propose_next_pass(backward_follows)

    def _release_kept(self) -> None:
        """Let the root's units kept for a backward go (they are freed with the next unheld units)."""
        for index in self.root_units:
            self._holds[index].backward = False

    def _release_all(self) -> None:
        self._holds = [_Holds() for _ in self.units]
        if not self._diverged:
            self.schedule.launch_all()
        self._free_unheld()

    # -- called by the engine around backward ------------------------------------------------

    def begin_backward(self) -> None:
        self.peak_backward_bytes = self._live_bytes()
        self.schedule.begin_pass(PassKind.BACKWARD)
        if self.reducer is not None:  # units whose modules did not run get no gradient here
            self.reducer.settle(
                [unit for index, unit in enumerate(self.units) if index not in self._ran and not unit.frozen]
            )

    def end_backward(self) -> None:
        """Before the reducer's end: other ranks may need this rank's drain rows to end their
        backward and launch the reductions this rank will wait for."""
        for holds in self._holds:
            holds.backward, holds.backward_calls = False, 0
        self._backward_ended = True
        self._end_pass()
        self._propose_next_pass(backward_follows=False)

    def unit_complete(self, unit: FlatUnit) -> None:
        """Every parameter of ``unit`` has its gradient: its values are needed no more."""
        index = self._index.get(id(unit))
        if index is not None and self._holds[index].backward:
            self._holds[index].backward = False
            if not self._holds[index].held:
                self._reshard(index)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._unwatch()

    def peaks(self) -> tuple[int, int]:
        """Most gathered-parameter bytes alive in the last forward and the last backward."""
        return self.peak_forward_bytes, self.peak_backward_bytes

    # -- module hooks ----------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        needs = self._needs[module]
        self._running.append(module)
        call = _Call(tuple(index for index in needs if self.units[index].frozen))
        self._calls.append(call)
        self._free_served()
        self._ran.update(needs)
        for index in needs:
            self._holds[index].forward += 1
            self._ensure_gathered(index)
            if index not in self._order:
                self._order.append(index)
        self._prefetch_after(needs, self._recorded, window=WANTS_PER_ROW)
        if call.frozen and torch.is_grad_enabled():
            return self._signal_post_backward(call, args, kwargs)
        return None

    def _signal_post_backward(
        self, call: _Call, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]] | None:
        """Pass the call's input tensors that need a gradient through `_PostBackward`, whose
        backward releases the call's frozen units (None: no input needs one; the backward's end
        frees them then)."""
        flat = [*args, *kwargs.values()]
        positions = [i for i, value in enumerate(flat) if isinstance(value, torch.Tensor) and value.requires_grad]
        if not positions:
            return None
        passed = _PostBackward.apply(functools.partial(self._post_backward, call), *[flat[i] for i in positions])
        for i, tensor in zip(positions, passed):
            flat[i] = tensor
        return tuple(flat[: len(args)]), dict(zip(kwargs, flat[len(args) :]))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        needs = self._needs[module]  # with what reads served in this forward added
        call = _Call(())
        if self._running and self._running[-1] is module:
            self._running.pop()
            call = self._calls.pop()
        if torch.is_grad_enabled():
            hook = functools.partial(self._pre_backward, needs, call)
            for tensor in iter_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(hook)
        keep = self._keep_after_forward(module)
        for index in needs:
            self._holds[index].forward = max(0, self._holds[index].forward - 1)
            if not self._holds[index].held and not keep:
                self._reshard(index)

    def _keep_after_forward(self, module: nn.Module) -> bool:
        """Whether ``module``'s units stay gathered when its forward ends: the root's, with
        gradients on, for a backward that starts with them (as FSDP2 keeps its root). The rest
        of that one decision: `_exit_root` holds them for the backward if the output needs a
        gradient, else frees them; a collective call before the backward (`settle_for_call`)
        or the next forward (`_release_all`) lets them go."""
        return module is self._root and torch.is_grad_enabled()

    def _pre_backward(self, needs: tuple[int, ...], call: _Call, grad: torch.Tensor) -> None:
        self._free_served()
        first = not call.backward_started
        call.backward_started = True
        for index in needs:
            holds = self._holds[index]
            if self.units[index].frozen:  # held per call, until that call's post-backward
                if first and index in call.frozen:
                    holds.backward_calls += 1
                self._ensure_gathered(index)
            elif not holds.backward:
                holds.backward = True
                self._ensure_gathered(index)
        if not self._prefetch_after(needs, self._recorded[::-1], window=1):
            self.schedule.issue()  # still tell the ranks which reductions are launched here

    def _post_backward(self, call: _Call) -> None:
        """The gradients of ``call``'s inputs are computed: its frozen units are needed no more
        for it (a trainable unit waits for its gradients instead, `unit_complete`)."""
        if not call.backward_started or call.backward_done:
            return
        call.backward_done = True
        for index in call.frozen:
            holds = self._holds[index]
            holds.backward_calls = max(0, holds.backward_calls - 1)
            if not holds.held and self.units[index].has_full_storage:
                self._reshard(index)

    # -- parameters read outside the hooks (see `zero_engine.sharding.param_access`) -------------

    def _on_read(self, param: nn.Parameter) -> None:
        """A module's parameter was read during a forward: gather its unit there unless some
        module running holds it already (the common case: its own module's forward).

        Nothing to do inside a compiled forward (its unit is gathered around it), asked first:
        dynamo traces this, and a unit's own state read here became a guard of every compiled
        unit forward, so each unit recompiled the shared code, and past dynamo's limit of 8
        the rest ran eager (seen on an H200: a recompile per GPT block)."""
        if torch.compiler.is_compiling():
            return
        index = self._unit_of.get(param)
        if index is not None and not self._holds[index].forward:
            self._serve_read(index, param)

    def _serve_read(self, index: int, param: nn.Parameter) -> None:
        """The module running now (the innermost hooked one) needs unit ``index`` from here on:
        gathered now and held until that module's forward ends, and in every later forward and
        backward of it, with its other units."""
        holder = self._running[-1] if self._running else self._root
        where = _label(self._path_of(holder))
        if threading.get_ident() != self._forward_thread:
            raise ShardedParameterError(
                f"stage 3: parameter {self._name_of(param)!r} (unit {self.units[index].label!r}) was read from "
                f"another thread during the forward of {where}: its unit is sharded, and a "
                "gather must run on the forward's thread, in the same order on every rank. Read it on that thread, "
                f"or keep it whole on every rank (zero_optimization.stage3_param_persistence_threshold above "
                f"{self._numel_of(param)})"
            )
        self.check_usable()
        self._needs[holder] = (*self._needs[holder], index)
        if self.comm.rank == 0:
            logger.info(
                "stage 3: unit %r is read outside the modules that gather it (first: %r, during the forward of %s); "
                "it is gathered with %s's units from now on",
                self.units[index].label, self._name_of(param), where, where,
            )
        self._ran.add(index)
        self._holds[index].forward += 1
        self._ensure_gathered(index)
        if index not in self._order:
            self._order.append(index)

    def explain_failed_forward(self, error: BaseException) -> str | None:
        """When a forward failed on a sharded parameter that nothing gathered (a reference kept
        outside its module: a list, a closure), what to say instead of torch's shape error."""
        if isinstance(error, ShardedParameterError):
            return None  # said already
        for param, frame in unserved_reads(error, self._is_sharded_empty):
            user = frame.f_locals.get("self")
            where = f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
            if isinstance(user, nn.Module):
                where = f"module {_label(self._path_of(user))} ({type(user).__name__}), {where}"
            index = self._unit_of[param]
            return (
                f"stage 3: parameter {self._name_of(param)!r} (unit {self.units[index].label!r}) was used in a forward "
                f"while sharded, by {where}, through a reference the engine cannot see: it gathers a unit when a "
                "module that registers the parameter runs, or when the forward reads it from its module "
                "(module.weight). Read it from its module where it is used, register it on the module that uses it, or keep it whole "
                f"on every rank (zero_optimization.stage3_param_persistence_threshold above {self._numel_of(param)})"
            )
        return None

    def _numel_of(self, param: nn.Parameter) -> int:
        unit = self.units[self._unit_of[param]]
        return unit.layout.param_numels[next(i for i, own in enumerate(unit.params) if own is param)]

    def _is_sharded_empty(self, value: Any) -> bool:
        index = self._unit_of.get(value) if isinstance(value, nn.Parameter) else None
        return index is not None and value.numel() == 0 and not self.units[index].has_full_storage

    def _name_of(self, param: nn.Parameter) -> str:
        unit = self.units[self._unit_of[param]]
        return next(name for name, own in zip(unit.names, unit.params) if own is param)

    def _path_of(self, module: nn.Module) -> str | None:
        return next((path for path, candidate in self._root.named_modules() if candidate is module), None)

    # -- gathering -------------------------------------------------------------------------------

    def _ensure_gathered(self, index: int) -> None:
        if not self.units[index].has_full_storage:
            self._gather(index)
        self._complete(index)

    def _complete(self, index: int) -> None:
        """Wait for the unit's gather, if one is in flight (not after a divergence, when the
        other ranks may never send)."""
        self.units[index].wait_for_unshard(wait=not self._diverged)

    def _prefetch_after(self, needs: tuple[int, ...], order: list[int], window: int) -> bool:
        """Start gathering the unit that followed ``needs`` in ``order``, if it fits, and,
        when the one after it is not agreed yet, propose the window (of up to ``window`` units)
        that starts there; whether a round was issued.

        The backward proposes one unit at a time: it sends a row per unit anyway (each reports
        the reductions launched, which the reducer needs before it may wait for one), and a
        longer queue of agreed gathers would keep the reducer from waiting (it may not wait
        while a gather is queued), costing a gradient bucket more.

        Every decision to issue a round reads what is *claimed* (gathered, or agreed and not
        launched yet), never whether a gather was launched already: a rank launches agreed
        gathers early before it blocks, and the ranks must still issue the same rounds in the
        same order when they run the same modules, or the rounds would pair one rank's proposal
        with another's and gather units twice. Launching an agreed gather early is this rank's
        own choice: every rank launches the same sequence, each when it needs to."""
        positions = [order.index(index) for index in needs if index in order]
        if not positions:
            return False
        after = max(positions)
        if after + 1 < len(order) and not self.units[order[after + 1]].has_full_storage:
            following = order[after + 1]
            agreed = self.schedule.queued(following)
            if self._fits(following, counting=self._gathered if agreed else self._claimed):
                self._gather(following)  # not agreed yet: a round first
        if after + 2 < len(order) and not self._claimed(order[after + 2]):
            proposal = self._window(order[after + 2 :], window)
            if proposal:
                self.schedule.issue(proposal)
                return True
        return False

    def _claimed(self, index: int) -> bool:
        return self.units[index].has_full_storage or self.schedule.asked(index)

    def _gathered(self, index: int) -> bool:
        return self.units[index].has_full_storage

    def _fits(self, index: int, counting: Callable[[int], bool]) -> bool:
        """Prefetching ``index`` stays within both limits, counting the units ``counting`` says."""
        numel = self.units[index].layout.padded_numel
        others = sum(unit.layout.padded_numel for i, unit in enumerate(self.units) if i != index and counting(i))
        return numel <= self.prefetch_numel and others + numel <= self.max_live_numel

    def _window(self, expected: list[int], size: int = WANTS_PER_ROW) -> list[int]:
        """The units to propose in one round: the first unclaimed ones of ``expected``, at most
        ``size``, together within ``stage3_prefetch_bucket_size`` and, with every claimed unit,
        within ``stage3_max_live_parameters`` (a rank that blocks on a round launches everything
        agreed first)."""
        claimed = sum(unit.layout.padded_numel for i, unit in enumerate(self.units) if self._claimed(i))
        budget = min(self.prefetch_numel, self.max_live_numel - claimed)
        window: list[int] = []
        for index in dict.fromkeys(expected):
            if self._claimed(index):
                continue
            numel = self.units[index].layout.padded_numel
            if numel > budget or len(window) == size:
                break
            window.append(index)
            budget -= numel
        return window

    # -- agreeing on every gather (see `zero_engine.sharding.agreement`) -------------------------

    def _gather(self, index: int) -> None:
        """Launch the gather of ``index`` once every rank has agreed on it."""
        self.schedule.need(index)

    def _propose_next_pass(self, backward_follows: bool) -> None:
        """Propose the first window of the pass expected next, so it starts without waiting:
        a backward starts at the root's output and runs the recorded order backwards (its first
        two units: the rest one at a time, see `_prefetch_after`); a forward runs it forwards.
        A wrong guess costs a wasted gather, never a wrong one."""
        if self._diverged:
            return
        if backward_follows:
            window = self._window([*self.root_units, *reversed(self._recorded)], size=2)
        else:
            window = self._window(self._recorded)
        if window:
            self.schedule.issue(window)

    def _launch_gather(self, index: int, wanted: bool) -> None:
        """The schedule's turn for this gather: every rank launches it (again, in place, where
        the unit is gathered already). One only other ranks wanted is freed at this rank's next
        module hook unless something here holds it by then."""
        self.units[index].unshard(self.comm)
        if not wanted:
            self._served.add(index)
        self._note_peak()

    def _free_served(self) -> None:
        for index in self._served:
            if not self._holds[index].held and self.units[index].has_full_storage:
                self._reshard(index)
        self._served.clear()

    def _end_pass(self) -> None:
        """Every rank has issued the same rounds and launched every agreed gather; free what
        nobody here holds."""
        if not self._diverged:
            self.schedule.end_pass()
        self._served.clear()
        self._free_unheld()

    def _describe(self, index: int) -> str:
        if 0 <= index < len(self.units):
            return f"unit {self.units[index].label!r}"
        return f"an unknown unit ({index})"

    def _reshard(self, index: int) -> None:
        self._complete(index)
        self.units[index].reshard()

    def _free_unheld(self, wait: bool = False) -> None:
        """Free every gathered unit nobody here holds (``wait``: let its gather complete first,
        rather than abandon the buffer to it)."""
        for index, unit in enumerate(self.units):
            if unit.has_full_storage and not self._holds[index].held:
                if wait:
                    unit.wait_for_unshard()
                self._reshard(index)

    # -- accounting ------------------------------------------------------------------------------

    def _live_bytes(self) -> int:
        return sum(unit.gathered_bytes for unit in self.units if unit.has_full_storage)

    def _note_peak(self) -> None:
        live = self._live_bytes()
        if self.lifecycle.state is TrainingState.FORWARD:
            self.peak_forward_bytes = max(self.peak_forward_bytes, live)
        else:
            self.peak_backward_bytes = max(self.peak_backward_bytes, live)


def _label(path: str | None) -> str:
    return "<root>" if path == "" else repr(path) if path is not None else "a module outside the model"


@dataclass
class _Holds:
    """Who needs a unit gathered: modules running their forward (counted: nested and tied
    uses share one gather), and its backward until every parameter has its gradient (a
    trainable unit), or until the post-backward of each call whose backward began (a frozen
    one)."""

    forward: int = 0
    backward: bool = False
    backward_calls: int = 0

    @property
    def held(self) -> bool:
        return self.forward > 0 or self.backward or self.backward_calls > 0


@dataclass(eq=False)
class _Call:
    """One call of a hooked module: the frozen units it needs, and where its backward is."""

    frozen: tuple[int, ...]
    backward_started: bool = False
    backward_done: bool = False


class _PostBackward(torch.autograd.Function):
    """Identity over a module call's inputs; its backward runs once their gradients are
    computed, i.e. after every operation of the call, and tells the gatherer."""

    @staticmethod
    def forward(ctx: Any, on_backward: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.on_backward = on_backward
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.on_backward()
        return (None, *grads)
