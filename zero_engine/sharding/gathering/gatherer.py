"""Stage 3: gather each unit's parameters around the modules that use them, free them after.

Forward: a unit module's pre-hook gathers the units it needs (counted, so nested and tied
uses share one gather) and starts the all-gather of the next unit in the order recorded by
the previous forward; its post-hook releases them, and a unit nobody holds is freed. A sharded
parameter read during a forward while no hook holds its unit (a head's ``F.linear(h,
self.embed.weight)``, the members of a container whose own forward never runs) gathers its
unit where it is read (`zero_engine.sharding.gathering.param_access`): the unit joins what the module
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
what every rank asked for (`zero_engine.sharding.gathering.agreement`), with the reductions of the
gradients: ranks that run different modules (a mixture of experts, a data-dependent branch)
take part in each other's gathers instead of hanging, aborting in the transport on mismatched
sizes or filling one unit with another's values. Agreeing synchronously before every gather
stalls every rank at every gather (about 8% of a step here, see ``docs/benchmarks.md``), so
gathers are proposed ahead, a *window* of the recorded order at a time (up to
`WANTS_PER_ROW` units in one round): at the end of a pass for the next one's first units, and
when a prefetch reaches the end of what is agreed. The agreement completes in the background
and the prefetches launch without waiting. A proposal that turns out wrong costs a wasted
gather, never a wrong one.

Prefetching launches one unit ahead, within ``stage3_prefetch_bucket_size`` and
``stage3_max_live_parameters`` (`zero_engine.sharding.gathering.prefetch`).

Who holds a unit, and why, is counted per reason (`zero_engine.sharding.gathering.holds`): the hooks take
forward, backward and per-call holds; `ParamGatherer.hold` and `ParamGatherer.release` are the
same decision for code outside the hooks (a user's hold lasts across passes until released).

The root unit stays gathered from the end of a forward that a backward follows to its backward
(as FSDP2 keeps its root): that backward starts with it, and it is held through the forward
anyway, so this saves a gather and costs no memory at any peak.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ...comm import Comm
from ...tree import iter_tensors
from .agreement import WANTS_PER_ROW, CollectiveSchedule, PassKind
from ..units.frozen_unit import FrozenUnit
from .holds import GatheredUnits, HoldReason, ModuleCall, PassRecord, signal_post_backward
from ..units.lifecycle import Lifecycle, TrainingState
from .param_access import ParamReads
from .prefetch import Prefetcher
from ..reduction.reducer import GradReducer
from .root_methods import RootMethods
from ..units.unit import FlatUnit, ShardedFlatUnit

FORWARD, BACKWARD, CALL, USER = HoldReason.FORWARD, HoldReason.BACKWARD, HoldReason.CALL, HoldReason.USER


class NoGather:
    """Stages 0-2: parameters are always whole; nothing to gather."""

    def begin_backward(self) -> None: ...

    def end_backward(self) -> None: ...

    def propose_next_pass(self) -> None: ...

    def check_resharded(self, call: str) -> None: ...

    def unit_complete(self, unit: FlatUnit) -> None: ...

    def attach_reducer(self, reducer: GradReducer) -> None: ...

    def may_wait_for_reduction(self, index: int) -> bool:
        """Stages 0-2: always (see `ParamGatherer.may_wait_for_reduction`)."""
        return True

    def hold(self, units: Iterable[int], reason: HoldReason = USER, first: Callable[[], None] | None = None) -> None:
        """Stages 0-2: every unit is whole already (``first`` runs all the same)."""
        if first is not None:
            first()

    def release(self, units: Iterable[int], reason: HoldReason = USER) -> None: ...

    def index_of(self, unit: object) -> int | None:
        """Stages 0-2: no unit is gathered."""
        return None

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
        self._index = {id(unit): index for index, unit in enumerate(self.units)}
        self.gathered = GatheredUnits(
            self.units, lambda: self.schedule.diverged, lambda: lifecycle.state is TrainingState.FORWARD
        )
        self._holds = self.gathered.holds
        self.schedule = CollectiveSchedule(
            comm, self._launch_gather, lambda index: self.units[index].has_full_storage, self.gathered.describe
        )
        self.prefetch = Prefetcher(self.units, self.schedule, prefetch_numel, max_live_numel)
        self.reducer: GradReducer | None = None
        self.passes = PassRecord()  # which units this forward used, and in what order the last one did
        # What each hooked module needs gathered while it runs (a read served outside the hooks
        # adds to it), the root always among them; the hooked modules running, innermost last.
        self._needs: dict[nn.Module, tuple[int, ...]] = {root: ()}
        self._needs.update(hooked)
        self._running: list[nn.Module] = []
        self._calls: list[ModuleCall] = []  # the calls of the hooked modules running, as `_running`
        self._root = root
        self.reads = ParamReads(root, self.units, self._on_read, comm.rank)
        self._handles = self._register_hooks(root)
        self._methods = RootMethods(  # its generate, run as one forward of it, every rank as many forwards
            root, lifecycle, (self._enter_root, self._pre_forward), (self._post_forward, self._exit_root),
            synced=comm.mesh.world > 1,
        )

    def _register_hooks(self, root: nn.Module) -> list[Any]:
        """The root's outer hooks bracket every forward, whoever calls the model: registered
        first (pre) and last (post), so they run around the unit hooks of the root itself."""
        handles = [root.register_forward_pre_hook(self._enter_root)]
        for module in self._needs:
            handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            handles.append(module.register_forward_hook(self._post_forward, always_call=True))
        return [*handles, root.register_forward_hook(self._exit_root, always_call=True)]

    @property
    def root_units(self) -> tuple[int, ...]:
        return self._needs[self._root]

    # -- holds taken outside the hooks -------------------------------------------------------

    def hold(self, units: Iterable[int], reason: HoldReason = USER, first: Callable[[], None] | None = None) -> None:
        """Keep ``units`` gathered for ``reason`` until as many `release` calls, gathering those
        that are not (agreed like every gather: every rank holds the same units in the same
        order). Holds of one reason nest; other reasons' releases do not free these units.
        ``first`` runs once the holds are taken and before any gather (a collective call's row,
        whose settling then keeps a held unit that a prefetch has gathered already)."""
        self.check_usable()
        units = list(units)
        for index in units:
            self._holds.take(index, reason)
        if first is not None:
            try:
                first()
            except BaseException:
                for index in units:
                    self._holds.drop(index, reason)
                raise
        for index in units:
            self._ensure_gathered(index)  # a gather launched here notes the peak (`GatheredUnits.launched`)

    def release(self, units: Iterable[int], reason: HoldReason = USER) -> None:
        """Let one of ``reason``'s holds on each of ``units`` go; a unit nobody holds then is freed."""
        for index in units:
            self.gathered.release(index, reason)

    def index_of(self, unit: object) -> int | None:
        """The index `hold` and `release` take for ``unit`` (None: not one of the gathered units)."""
        return self._index.get(id(unit))

    # -- a whole forward ---------------------------------------------------------------------

    def attach_reducer(self, reducer: GradReducer) -> None:
        """The rows report how many of ``reducer``'s reductions were launched; units whose
        modules did not run are settled with it at the start of each backward."""
        self.reducer = reducer
        self.schedule.reductions = reducer

    def may_wait_for_reduction(self, index: int) -> bool | None:
        """Whether every rank has launched the reduction of the reducer's unit ``index`` (their rows say), so waiting
        for it cannot wait for a rank waiting for this one; None while rounds that may say so are in flight."""
        return self.schedule.may_wait_for(index)

    def check_usable(self) -> None:
        """Every call raises after a divergence (`CollectiveSchedule.check_usable`)."""
        self.schedule.check_usable()

    def settle_for_call(self) -> None:
        """After a collective call's row (`zero_engine.sharding.gathering.calls.PassCallGuard`): every unit
        sharded for the call (a load writes shards)."""
        self._release_kept()  # a backward that follows gathers the root again
        # It launched the gathers agreed before (prefetches proposed for the next pass): let
        # them complete and free them, so that every unit is sharded for the call (a load
        # writes shards) and no buffer is abandoned to a collective in flight.
        self.gathered.free_unheld(wait=True)

    def _enter_root(self, module: nn.Module, args: Any) -> None:
        self.check_usable()
        if self.lifecycle.forward_depth == 1:  # the outermost call
            if any(full and not self._holds.count(index, USER) for index, full in enumerate(self.gathered.full())):
                self._release_pass_holds()  # a backward raised half-way, or no backward came (a user's hold stays)
            self.reads.begin_forward()
            self.schedule.begin_pass(PassKind.FORWARD)
            self.passes.forward_begins()
            self.gathered.begin_peak(forward=True)

    def _exit_root(self, module: nn.Module, args: Any, output: Any) -> None:
        """Runs even when the forward raised (``always_call``): every unit hook has released
        its units by then, so a failed forward leaves nothing gathered."""
        if self.lifecycle.forward_depth == 0:
            self.reads.end_forward()
            self.passes.forward_ends()
            backward_follows = any(t.requires_grad for t in iter_tensors(output))
            if backward_follows:  # the root's units still gathered are kept for the backward, which starts with them
                for index in self.root_units:
                    self._holds.set(index, BACKWARD, self.units[index].has_full_storage)
            self._end_pass()  # frees what nobody holds (the root's units too, when no backward follows)
            self.prefetch.propose_next_pass(self.passes.recorded, self.root_units, backward_follows)

    def _release_kept(self) -> None:
        """Let the root's units kept for a backward go (they are freed with the next unheld units)."""
        for index in self.root_units:
            self._holds.set(index, BACKWARD, False)

    def _release_pass_holds(self) -> None:
        self._holds.clear()
        if not self.schedule.diverged:
            self.schedule.launch_all()
        self.gathered.free_unheld()

    # -- called by the engine around backward ------------------------------------------------

    def begin_backward(self) -> None:
        self.gathered.begin_peak(forward=False)
        self.schedule.begin_pass(PassKind.BACKWARD)
        if self.reducer is not None:  # units whose modules did not run get no gradient here
            self.reducer.settle(
                [unit for index, unit in enumerate(self.units) if not self.passes.ran(index) and not unit.frozen]
            )

    def end_backward(self) -> None:
        """Before the reducer's end: other ranks may need this rank's drain rows to end their
        backward and launch the reductions this rank will wait for."""
        self._holds.clear((BACKWARD, CALL))
        self.passes.backward_ends()
        self._end_pass()

    def propose_next_pass(self) -> None:
        """After the reducer's end (`zero_engine.engine.Engine._end_backward`): the next
        forward's first window is proposed only once this backward's reductions are all
        launched. Proposed before, its round could arrive while the reducer waits for room for
        a unit that got no gradient (a head left out of the loss); on NCCL that wait launches
        every agreed gather first, so a rank whose round had arrived gathered the next
        forward's units before its step, ahead of the step's norm all-reduce on the same
        communicator, while the others launched them after: a hang without hybrid sharding,
        pre-step shards in a peer's forward with it (GPU review Q1)."""
        self.prefetch.propose_next_pass(self.passes.recorded, self.root_units, backward_follows=False)

    def check_resharded(self, call: str) -> None:
        self.gathered.check_resharded(call)  # before the step writes the shards: no stray gather

    def unit_complete(self, unit: FlatUnit) -> None:
        """Every parameter of ``unit`` has its gradient: its values are needed no more."""
        index = self._index.get(id(unit))
        if index is not None and self._holds.count(index, BACKWARD):
            self.gathered.release(index, BACKWARD)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._methods.restore()
        self.reads.close()

    def peaks(self) -> tuple[int, int]:
        """Most gathered-parameter bytes alive in the last forward and the last backward."""
        return self.gathered.peak_forward_bytes, self.gathered.peak_backward_bytes

    # -- module hooks ----------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        needs = self._needs[module]
        self._running.append(module)
        call = ModuleCall(tuple(index for index in needs if self.units[index].frozen))
        self._calls.append(call)
        self.gathered.free_served()
        for index in needs:
            self._use_in_forward(index)
        self.prefetch.after(needs, self.passes.recorded, window=WANTS_PER_ROW)
        if call.frozen and torch.is_grad_enabled():
            # a frozen unit gets no gradient to end its backward hold: the call's inputs signal it
            return signal_post_backward(functools.partial(self._post_backward, call), args, kwargs)
        return None

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        needs = self._needs[module]  # with what reads served in this forward added
        call = ModuleCall(())
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
            self.gathered.release(index, FORWARD, keep=keep)

    def _keep_after_forward(self, module: nn.Module) -> bool:
        """Whether ``module``'s units stay gathered when its forward ends: the root's, with
        gradients on, for a backward that starts with them (as FSDP2 keeps its root). The rest
        of that one decision: `_exit_root` holds them for the backward if the output needs a
        gradient, else frees them; a collective call before the backward (`settle_for_call`)
        or the next forward (`_release_pass_holds`) lets them go."""
        return module is self._root and torch.is_grad_enabled()

    def _pre_backward(self, needs: tuple[int, ...], call: ModuleCall, grad: torch.Tensor) -> None:
        self.gathered.free_served()
        first = not call.backward_started
        call.backward_started = True
        for index in needs:
            if self.units[index].frozen:  # held per call, until that call's post-backward
                if first and index in call.frozen:
                    self._holds.take(index, CALL)
                self._ensure_gathered(index)
            elif not self._holds.count(index, BACKWARD):
                self._holds.set(index, BACKWARD, True)
                self._ensure_gathered(index)
        if not self.prefetch.after(needs, self.passes.recorded[::-1], window=1):
            self.schedule.issue()  # still tell the ranks which reductions are launched here

    def _post_backward(self, call: ModuleCall) -> None:
        """The gradients of ``call``'s inputs are computed: its frozen units are needed no more
        for it (a trainable unit waits for its gradients instead, `unit_complete`)."""
        if not call.backward_started or call.backward_done:
            return
        call.backward_done = True
        for index in call.frozen:
            self.gathered.release(index, CALL)

    # -- parameters read outside the hooks (see `zero_engine.sharding.gathering.param_access`) -------------

    def _on_read(self, index: int, param: nn.Parameter) -> None:
        """A parameter of unit ``index`` was read in a forward (`ParamReads`): unless a running
        module holds the unit (its own, commonly), the innermost running hooked module needs it
        from here on: gathered now, held until that forward ends, and in its later passes."""
        if self._holds.count(index, FORWARD):
            return
        holder = self._running[-1] if self._running else self._root
        self.reads.check_thread(param, holder)
        self.check_usable()
        self._needs[holder] = (*self._needs[holder], index)
        self.reads.log_served(param, holder)
        self._use_in_forward(index)

    def _use_in_forward(self, index: int) -> None:
        """Unit ``index`` is used in this forward: it ran, it is held, gathered, in the order."""
        self.passes.used(index)
        self._holds.take(index, FORWARD)
        self._ensure_gathered(index)

    def explain_failed_forward(self, error: BaseException) -> str | None:
        return self.reads.explain_failed_forward(error)

    # -- gathering, agreed on every rank (see `zero_engine.sharding.gathering.agreement`) ------------------

    def _ensure_gathered(self, index: int) -> None:
        if not self.units[index].has_full_storage:
            self.schedule.need(index)  # launched once every rank has agreed on it
        self.gathered.complete(index)

    def _launch_gather(self, index: int, wanted: bool) -> None:
        """The schedule's turn for this gather: every rank launches it (again, in place, where
        the unit is gathered already)."""
        self.units[index].unshard(self.units[index].sharded_over(self.comm))
        self.gathered.launched(index, wanted)

    def _end_pass(self) -> None:
        """Every rank has issued the same rounds and launched every agreed gather; free what
        nobody here holds."""
        if not self.schedule.diverged:
            self.schedule.end_pass()
        self.gathered.free_unheld()
