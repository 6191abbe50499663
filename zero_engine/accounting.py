"""What each kind of model state holds on one rank, and on which tier: the memory formula's terms.

A plan (`zero_engine.offload.OffloadPlan`) puts each kind of state on a tier; each tier declares
here the bytes per element it holds of what it is given and whether they are divided over the
shard group, and the optimizer kind its state bytes (`zero_engine.optimizer_kinds`).
`zero_engine.memory` sums the declarations into the report, `zero-engine estimate` prints them
by tier with each tier's own note, and `initialize` asks each tier to check its room
(`check_room`), so neither names a tier. A new tier is a `Tier`, its class
(`sharding/tiers/placement.py`) and its rows here.

On the device every kind is held in the compute dtype, masters in fp32 under mixed precision or
when the parameter shards are off the device (``offload_param`` with the optimizer on the device:
the step updates a device master, in fp32 training too).
Off it (``offload_optimizer``), the shard's master is a separate fp32 copy (also in fp32
training, except when the parameter shard is on the host too), its gradient an fp32 tensor
beside the optimizer state (4 bytes, whatever the compute dtype; at stage 1 beside the device's
full gradients), all on the optimizer side's tier; ``offload_param`` puts stage 3's parameter
shards, frozen ones too, on theirs. NVMe keeps a few buffers in flight in host memory, bounded by
``buffer_count``, not counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .offload import OffloadPlan, Tier
from .stage import Stage


@dataclass(frozen=True)
class Counted:
    """One term of the formula: bytes of one kind of state (a `MemoryReport` field) on one rank,
    what part of it they are, and the tier that holds them."""

    kind: str  # parameters, gradients, optimizer_states, master_parameters
    part: str  # what they are: "parameters", "frozen parameters", "gradients", "step gradient", ...
    tier: Tier
    nbytes: int


@dataclass(frozen=True)
class Holding:
    """What a rank trains and keeps: its element counts, bytes per element as computed, and the
    optimizer's state bytes per trainable element."""

    trainable: int
    frozen: int
    group: int  # the shard group: what a sharded kind is divided over
    mixed: bool  # fp16 / bf16 compute: 2-byte parameters and gradients, fp32 masters
    optimizer_bytes: float
    frozen_bytes: float  # a frozen element as stored (int8 at stage 3 when asked)
    frozen_sharded: bool  # stage 3 and ``frozen_weights: shard``
    experts: int = 0  # of ``trainable``, the elements of experts owned per rank (``expert_parallel_size``)
    expert_parallel: int = 1  # E: each rank holds 1/E of the experts, sharded over group / E ranks

    def per_rank(self, bytes_per_element: float, sharded: bool) -> int:
        """A trainable kind's bytes on one rank: sharded, a 1/group share (the experts' 1/E
        split over group / E owners is the same share); whole, every dense element and this
        rank's 1/E of the experts."""
        if sharded:
            return round(self.trainable * bytes_per_element) // self.group
        held = self.trainable - self.experts + self.experts // self.expert_parallel
        return round(held * bytes_per_element)


def declared(plan: OffloadPlan, stage: Stage, holding: Holding) -> list[Counted]:
    """The formula's terms for ``holding`` under ``plan`` at ``stage`` (ZeRO paper, section 5:
    stage 1 shards the optimizer state and masters, 2 the gradients too, 3 the parameters too)."""
    compute = 2 if holding.mixed else 4
    counted = [Counted("parameters", "parameters", plan.param_shards.tier,
                       holding.per_rank(compute, stage.shard_parameters))]
    frozen = int(holding.frozen * holding.frozen_bytes) // (holding.group if holding.frozen_sharded else 1)
    counted.append(Counted("parameters", "frozen parameters",
                           plan.param_shards.tier if holding.frozen_sharded else Tier.DEVICE, frozen))
    side = plan.state.tier
    states = holding.per_rank(holding.optimizer_bytes, stage.shard_optimizer_state)
    if side is Tier.DEVICE:
        counted += [
            Counted("gradients", "gradients", Tier.DEVICE, holding.per_rank(compute, stage.shard_gradients)),
            Counted("master_parameters", "masters", Tier.DEVICE,  # fp32: the parameter, when it is here
                    holding.per_rank(4 if holding.mixed or plan.params else 0, stage.shard_optimizer_state)),
            Counted("optimizer_states", "optimizer state", side, states),
        ]
        return counted
    fp32_shard = holding.trainable * 4 // holding.group
    shared_master = plan.params_on_host and not holding.mixed  # the host's parameter shard is the master
    if not stage.shard_gradients:  # stage 1 keeps full gradients on the device for backward
        counted.append(Counted("gradients", "gradients", Tier.DEVICE, holding.per_rank(compute, False)))
    counted += [
        Counted("gradients", "step gradient", side, fp32_shard),
        Counted("master_parameters", "masters", side, 0 if shared_master else fp32_shard),
        Counted("optimizer_states", "optimizer state", side, states),
    ]
    return counted


def bytes_of(counted: Sequence[Counted], *, tier: Tier | None = None, kind: str | None = None,
             part: str | None = None) -> int:
    """Bytes of the terms on ``tier``, of ``kind`` and of ``part``, each when given."""
    return sum(term.nbytes for term in counted
               if tier in (None, term.tier) and kind in (None, term.kind) and part in (None, term.part))


def by_tier(counted: Sequence[Counted]) -> dict[Tier, int]:
    """Bytes on each tier off the device that holds any."""
    return {tier: nbytes for tier in Tier if tier is not Tier.DEVICE and (nbytes := bytes_of(counted, tier=tier))}


def _nvme_note(counted: Sequence[Counted], stage: Stage) -> str:
    """What NVMe offload keeps in each rank's swap files and moves through them per step: the
    optimizer side (masters, state, step gradient) read and written once, the gradient once more
    each way for each further reduction into a window (stages 2-3: a micro-step); parameter
    shards read at each gather (a forward and a backward per micro-batch) and the trainable ones
    written once (frozen ones never)."""
    optimizer, shards = swap_file_bytes(counted)
    gradient = bytes_of(counted, tier=Tier.NVME, part="step gradient")
    frozen = bytes_of(counted, tier=Tier.NVME, part="frozen parameters")
    written = optimizer + shards - frozen
    parts = [f"masters, optimizer state and step gradient {optimizer / 2**30:.3f} GiB"] if optimizer else []
    parts += [f"parameter shards {shards / 2**30:.3f} GiB"] if shards else []
    reads = f"reads {optimizer / 2**30:.3f} GiB" if optimizer else "reads"
    reads += f"{' +' if optimizer else ''} {2 * shards / 2**30:.3f} GiB a micro-batch" if shards else ""
    further = (f"; each further micro-step reducing into a window reads and writes the gradient once more, "
               f"{gradient / 2**30:.3f} GiB" if gradient and stage.shard_gradients else "")
    return (f"(NVMe offload, in each rank's swap files: {', '.join(parts)}; a step {reads} and writes "
            f"{written / 2**30:.3f} GiB, {written * 1000 / 1e12:.3f} TB written per 1,000 steps{further})")


def swap_file_bytes(counted: Sequence[Counted]) -> tuple[int, int]:
    """NVMe's bytes as its two swap files hold them: the optimizer side's (masters, optimizer
    state and step gradient) and the parameter shards' (frozen ones too)."""
    shards = bytes_of(counted, tier=Tier.NVME, kind="parameters")
    return bytes_of(counted, tier=Tier.NVME) - shards, shards


def _check_nvme_room(plan: OffloadPlan, counted: Sequence[Counted], local_ranks: int) -> None:
    from .sharding.tiers.nvme import check_swap_directories

    check_swap_directories(plan, *swap_file_bytes(counted), local_ranks)


@dataclass(frozen=True)
class TierAccount:
    """How a tier off the device shows in the estimate (its label, what its line adds, a note
    printed before the states) and what it checks at `initialize` (room for its bytes)."""

    label: str
    remark: Callable[[int, int], str]  # (total model states, bytes off the device): the line's tail
    note: Callable[[Sequence[Counted], Stage], str] | None = None
    check_room: Callable[[OffloadPlan, Sequence[Counted], int], None] | None = None


TIER_ACCOUNTS: dict[Tier, TierAccount] = {
    Tier.NVME: TierAccount("on NVMe", lambda total, off: "(in host memory only around its use: a step, a gather)",
                           _nvme_note, _check_nvme_room),
    Tier.HOST: TierAccount("on the host",
                           lambda total, off: f"(offload; on the device: {(total - off) / 2**30:.3f} GiB)"),
}


def tier_notes(counted: Sequence[Counted], stage: Stage) -> list[str]:
    """The notes of the tiers that hold anything, printed before the states."""
    return [account.note(counted, stage) for tier, account in TIER_ACCOUNTS.items()
            if account.note is not None and bytes_of(counted, tier=tier)]


def tier_lines(counted: Sequence[Counted], total: int) -> list[str]:
    """One line per tier off the device that holds anything: its bytes and its remark."""
    off = sum(by_tier(counted).values())
    return [f"{account.label:18s} {nbytes / 2**30:10.3f} GiB  {account.remark(total, off)}"
            for tier, account in TIER_ACCOUNTS.items() if (nbytes := bytes_of(counted, tier=tier))]


def check_room(plan: OffloadPlan, counted: Sequence[Counted], local_ranks: int) -> None:
    """At `initialize`: each tier that checks its room for what this node's ranks put there
    (NVMe: each directory usable and large enough); nothing for the others."""
    for account in TIER_ACCOUNTS.values():
        if account.check_room is not None:
            account.check_room(plan, counted, local_ranks)
