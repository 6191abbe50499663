"""Expert parallelism (``expert_parallel_size: E``): each rank of a group of E consecutive ranks
owns ``num_experts / E`` consecutive experts of every mixture-of-experts block, and tokens travel
to their experts' owners by all-to-all and back, dropless (DeepSpeed-MoE's and torchtitan's
layout: every rank still reads its own micro-batches).

A block is found by structure, not by class name: a module with an ``experts`` module and a
router beside it (``gate`` or ``router``), whose experts hold *fused* weights, 3-D parameters
with one row per expert along dim 0 (transformers 5.x's Qwen3-MoE, Mixtral, OLMoE, DeepSeek
experts: ``gate_up_proj``, ``down_proj``, with ``num_experts``), called as
``experts(hidden_states, top_k_index, top_k_weights)``. A list of expert modules is refused by
name (a fused layout is what transformers builds from 5.0 on).

Two phases (`seam.ConvertsModel`):

1. ``convert`` (in `initialize`, before the param groups and the plan): each experts module
   keeps only this rank's experts, a new parameter of ``num_experts / E`` rows per fused weight
   (``num_experts`` set to match, so the model's own expert code, whichever implementation
   transformers picked, runs on them), and a placement for each: cut along dim 0 over the
   ``expert`` axis, so the units shard it over the ranks that own the same experts, checkpoints
   save it in the whole parameter's coordinates and state dicts gather it whole. The whole
   weights are kept until the forward phase, so a failed `initialize` gives the model back.
2. the forward phase wraps each experts module's ``forward``. The model's router has already
   chosen each token's top-k experts and weights; the wrapper sorts the (slot, token) routes by
   expert, exchanges the counts per owner and local expert (one small all-to-all: the splits
   differ by rank and by step), sends each route's hidden state to its expert's owner
   (`exchange`, an all-to-all whose backward is the reverse exchange), where the model's own
   expert forward runs with weight 1 on each source rank's rows apart (as one process runs that
   rank's micro-batch: the same products, the same sums of the weights' gradients), sends the
   outputs back, and combines them with the router's weights into each token's output, as the
   model's code does (a token's experts summed in ascending order, each expert's routes in the
   loop's order). Nothing is dropped and there is no capacity.

Every rank takes part in both exchanges of every block in every forward and backward, tokens or
not: the exchanged rows are made part of the graph on every rank whenever gradients are on, so a
rank whose experts got no token still runs the backward's exchanges its peers wait in. Such a
rank's expert weights still get their gradient (zeros) between the two exchanges, where the
other ranks' experts get theirs: the reducers launch units in order and may wait for one inside
the backward, so a unit left without a gradient until the backward's end would hold this rank's
later reductions back while a peer waits for them before its next exchange (a hang at stage 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from ..comm import CollectiveKind, GroupComm, Mesh
from ..comm.connecting import expected_place
from ..errors import ConfigError
from ..sharding.units.param_placement import Placement, ShardedOn
from .seam import MODEL, TransformTarget, WrappedForwards

ROUTER_NAMES = ("gate", "router")  # a router beside the experts: Hugging Face's names


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, experts module)`` of each mixture-of-experts block of ``model``: a module with
    an ``experts`` module and a router (`ROUTER_NAMES`) beside it."""
    found = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module) and any(isinstance(getattr(module, r, None), nn.Module) for r in ROUTER_NAMES):
            found.append((f"{name}.experts" if name else "experts", experts))
    return found


def _fused_weights(path: str, experts: nn.Module) -> tuple[int, dict[str, nn.Parameter]]:
    """The number of experts and the fused weights of one experts module, or a `ConfigError`
    naming it when it is not fused (a list of expert modules, no ``num_experts``)."""
    count = getattr(experts, "num_experts", None)
    own = dict(experts.named_parameters(recurse=False))
    children = [name for name, child in experts.named_children() if any(True for _ in child.parameters())]
    if not isinstance(count, int) or not own or children:  # an activation module beside the weights is fine
        raise ConfigError(
            f"expert_parallel_size: {path} ({type(experts).__name__}) is not a fused experts module (3-D weights "
            "with one row per expert and num_experts, as transformers 5 builds Qwen3-MoE and Mixtral): a list of "
            "expert modules is not built"
        )
    for name, param in own.items():
        if param.dim() < 2 or param.shape[0] != count:
            raise ConfigError(
                f"expert_parallel_size: {path}.{name} has shape {tuple(param.shape)}, not one row per expert of "
                f"{count} along dim 0"
            )
    return count, own


class ExpertParallel:
    """Experts owned per rank, tokens exchanged over the ``expert`` group (see the module)."""

    ORDER: ClassVar[int] = MODEL

    def __init__(self, size: int, place: Callable[[], tuple[int, int]] = expected_place) -> None:
        self.size = size
        self._place = place  # (rank, world size) before the ranks connect
        self.coordinate = 0
        self.placements: dict[nn.Parameter, Placement] = {}  # each kept expert weight's, for the plan
        self._replaced: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter, int]] = []
        self._forwards: list[WrappedForwards] = []
        self._owned: list[tuple[nn.Module, int]] = []  # after the forward phase: each experts module, its count

    # -- the first phase ---------------------------------------------------------------------

    def convert(self, model: nn.Module) -> None:
        blocks = moe_blocks(model)
        if not blocks:
            raise ConfigError(
                f"expert_parallel_size = {self.size}: {type(model).__name__} has no mixture-of-experts block (a "
                "module with an 'experts' module and a router, 'gate' or 'router', beside it)"
            )
        rank, world = self._place()
        mesh = Mesh.for_world(world, world, expert=self.size) if world % self.size == 0 else None
        if mesh is None:
            raise ConfigError(f"expert_parallel_size = {self.size} does not divide the world size {world}")
        self.coordinate = mesh.coordinates(rank).get("expert", 0)
        checked = [(path, experts, *_fused_weights(path, experts)) for path, experts in blocks]
        for path, _, count, _ in checked:
            if count % self.size:
                raise ConfigError(
                    f"expert_parallel_size = {self.size} does not divide the {count} experts of {path}: each rank "
                    "of an expert group owns an equal share"
                )
        for path, experts, count, weights in checked:
            meta = [name for name, whole in weights.items() if whole.is_meta]
            if meta:
                raise ConfigError(
                    f"expert_parallel_size = {self.size}: {path}.{meta[0]} is on the meta device; expert parallelism "
                    "of a model built on the meta device is not built (build it on the CPU or its GPU)"
                )
        for path, experts, count, weights in checked:
            local = count // self.size
            start = self.coordinate * local
            for name, whole in weights.items():
                kept = nn.Parameter(whole.detach()[start : start + local].clone(), requires_grad=whole.requires_grad)
                setattr(experts, name, kept)
                self.placements[kept] = Placement.cut(
                    whole.shape, (ShardedOn("expert", 0),), {"expert": self.coordinate}, {"expert": self.size},
                    f"{path}.{name}",
                )
                self._replaced.append((experts, name, whole, kept, count))
            experts.num_experts = local

    def whole_sources(self) -> list[tuple[nn.Parameter, torch.Tensor, int]]:
        """Before the forward phase: each kept expert weight, the whole weight it was cut from
        and where its rows start, so the engine can start every rank from rank 0's whole
        weights (`seam.ModuleTransforms.whole_sources`)."""
        return [(kept, whole.detach(), self.placements[kept].box.offsets[0]) for _, _, whole, kept, _ in self._replaced]

    def revert(self) -> None:
        """Before the forward phase: the whole weights back. After it (``close(unshard=True)``
        put the whole weights in), each experts module counts all its experts again."""
        for experts, count in self._owned:
            if all(param.shape[0] == count for param in experts.parameters(recurse=False)):
                experts.num_experts = count
        self._owned = []
        while self._replaced:
            experts, name, whole, _, count = self._replaced.pop()
            setattr(experts, name, whole)
            experts.num_experts = count
        self.placements.clear()

    # -- the forward phase -------------------------------------------------------------------

    def apply(self, target: TransformTarget) -> None:
        mesh = target.mesh
        if mesh.degree("expert") != self.size or mesh.coordinates(target.rank).get("expert", 0) != self.coordinate:
            raise RuntimeError(
                f"expert_parallel_size = {self.size}: this rank (global rank {target.rank}) kept the experts of "
                f"place {self.coordinate} before the ranks connected, but the mesh {mesh.axes} puts it elsewhere"
            )
        group = target.group("expert")
        modules = list(dict.fromkeys(experts for experts, *_ in self._replaced))
        self._forwards = [
            WrappedForwards([module], lambda forward, module=module: _dispatching(forward, module, group, self.size))
            for module in modules
        ]
        self._owned = [(experts, count) for experts, *_, count in self._replaced]
        self._replaced.clear()  # the whole weights are let go: from here this rank holds its experts only

    def remove(self) -> None:
        while self._forwards:
            self._forwards.pop().remove()


def _dispatching(
    forward: Callable[..., torch.Tensor], experts: nn.Module, group: GroupComm, size: int
) -> Callable[..., torch.Tensor]:
    """``forward`` of an experts module (this rank's experts), called with every token's routes
    as the model calls it, run on the tokens routed to this rank's experts by all of its group."""

    def dispatched(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   *args: Any, **kwargs: Any) -> torch.Tensor:
        def compute(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # weight 1: combined at the source
            return forward(rows, ids, torch.ones_like(ids, dtype=top_k_weights.dtype), *args, **kwargs)

        return route(hidden_states, top_k_index, top_k_weights, group, size, experts.num_experts, compute,
                     idle=lambda: sum(param.sum() for param in experts.parameters(recurse=False) if param.requires_grad))

    return dispatched


def route(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, group: GroupComm,
    size: int, local: int, compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    idle: Callable[[], torch.Tensor | int] = lambda: 0,
) -> torch.Tensor:
    """Each token's output: the sum over its routes of the router's weight times its expert's
    output, the experts computed by their owners (``compute(rows, local expert ids)``, this
    rank's ``local`` experts on what its group of ``size`` sent). When no row reaches this
    rank's experts, ``idle()`` (a sum of their weights) joins the graph times zero, so they get
    their gradient where a computing rank's do (see the module)."""
    tokens = top_k_index.shape[0]
    total = local * size
    flat = top_k_index.t().reshape(-1)  # slot-major: route ``slot * tokens + token``
    order = torch.argsort(flat, stable=True)  # by expert, then slot, then token: the model's loop's order
    counts = torch.bincount(flat.clamp(max=total), minlength=total + 1)[:total]  # a sentinel id (>= total) routes nowhere
    received_counts = torch.empty_like(counts)
    group.all_to_all(counts, received_counts, kind=CollectiveKind.ALL_TO_ALL).wait()
    send_rows = counts.view(size, local).sum(1).tolist()  # the host learns the splits: one sync a block
    order = order[: sum(send_rows)]
    token_of = order % tokens
    rows = hidden_states[token_of]
    if torch.is_grad_enabled() and not rows.requires_grad:
        rows = rows.detach().requires_grad_()  # every rank's exchanges in the graph (see the module)
    received_by_expert = received_counts.view(size, local)  # [source rank, local expert]
    receive_rows = received_by_expert.sum(1).tolist()
    received = exchange(rows, send_rows, receive_rows, group)
    ids = torch.repeat_interleave(
        torch.arange(local, device=flat.device).repeat(size), received_by_expert.reshape(-1)
    )
    # each source's rows computed apart, by local expert, as one process computes that rank's
    # micro-batch: the same products and the same sums of the weights' gradients
    outputs = torch.cat([
        compute(rows_from, ids_from.view(-1, 1)) if rows_from.shape[0] else rows_from.clone()
        for rows_from, ids_from in zip(received.split(receive_rows), ids.split(receive_rows))
    ]) if received.shape[0] else received.clone()
    if not received.shape[0] and torch.is_grad_enabled():
        outputs = outputs + 0.0 * idle()
    returned = exchange(outputs, receive_rows, send_rows, group)
    weights = top_k_weights.t().reshape(-1)[order].unsqueeze(1)
    combined = torch.zeros_like(hidden_states)
    return combined.index_add_(0, token_of, (returned * weights).to(hidden_states.dtype))


class _Exchange(torch.autograd.Function):
    """Rows to each group rank in order, as many as ``sent`` says, receiving ``received``'s;
    backward sends the gradients the other way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, sent: list[int], received: list[int], group: GroupComm) -> torch.Tensor:
        ctx.sent, ctx.received, ctx.group = sent, received, group
        return _exchanged(rows, sent, received, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchanged(grad, ctx.received, ctx.sent, ctx.group), None, None, None


def exchange(rows: torch.Tensor, sent: list[int], received: list[int], group: GroupComm) -> torch.Tensor:
    """``rows`` (consecutive, ``sent[j]`` of them for group rank ``j``) exchanged for
    ``received[j]`` rows from each rank ``j``, differentiable."""
    return _Exchange.apply(rows, sent, received, group)


def _exchanged(rows: torch.Tensor, sent: list[int], received: list[int], group: GroupComm) -> torch.Tensor:
    rows = rows.contiguous()
    width = math.prod(rows.shape[1:])
    out = rows.new_empty((sum(received), *rows.shape[1:]))
    group.exchange_pieces(rows.view(-1), [n * width for n in sent], out.view(-1), [n * width for n in received],
                          kind=CollectiveKind.ALL_TO_ALL).wait()
    return out
