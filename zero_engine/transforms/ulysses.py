"""Ulysses sequence parallelism (DeepSpeed-Ulysses, arXiv 2309.14509) as a module transform:
``sequence_parallel_size: k`` splits each sequence over ``k`` consecutive ranks, which read
the same micro-batch.

Every layer but attention works token by token, so each rank runs it on its slice of the
sequence (``1/k`` of every activation). Attention needs the whole sequence: before it, an
all-to-all over the sequence group turns "my slice of the sequence, all heads" into "the whole
sequence, my heads"; after it, a second one turns the output back. Both are autograd functions
whose backward is the opposite exchange.

For a Hugging Face model the transform works by config alone, at `initialize`:

- the model's own attention implementation (``sdpa`` or ``eager``) is wrapped and registered in
  transformers' attention registry under a name of ours, which the model's config points at
  until `remove`; nothing to register before ``from_pretrained``;
- a forward pre-hook on the model splits the micro-batch (training forwards, and evaluation's
  too unless ``sequence_parallel_eval`` is false: a sequence that trains split must evaluate
  split, or its first evaluation holds the whole sequence; ``generate`` and forwards with a
  cache see it whole): labels are shifted before the split, so no token loses its target at a
  slice boundary, ``position_ids`` stay global, and a length that ``k`` does not divide is
  padded at its end (padding attends to nothing before it and is ignored by the loss);
- each rank's loss is its slice's sum of token losses over the micro-batch's valid tokens
  (``num_items_in_batch``, Hugging Face's own argument), so the sequence group's gradients sum to
  the micro-batch's; a forward post-hook makes the returned loss's value the micro-batch's, as
  one process computes it, on every rank of the group (its gradient stays the slice's).

Masks are the whole sequence's, as one process's model builds them without a cache
(`whole_sequence_mask`): causal alone (no mask tensor) unless the batch is padded or packed.
Padded keys are masked over the whole sequence; a left pad, which has no key left, keeps the
empty row one process gives it (its output is read: the last pad predicts the first real
token). Packed documents (``position_ids`` restarting) keep their own positions and attend
within their document alone, as Hugging Face's packed-sequence mask keeps them apart in one
process: each document trains as if run alone; without padding each document's attention is
its own call, with no mask of tokens x tokens (a packed 128K-token row's would be 16 GiB).
Sliding windows (Mistral, and the sliding layers of Qwen2/3 and Gemma) are the whole sequence's
too: a layer whose attention call names its ``sliding_window`` gets the causal band of that
width over the whole sequence, as the model's own mask builds it in one process (a key ``j``
visible to query ``i`` when ``i - window < j <= i``). A model whose config asks for windows
but whose attention calls name none raises at its first split forward, naming the model, rather
than training full causal attention silently (Accelerate PR 4177's bug). Key/value heads fewer
than ``k`` (or not divisible by it) are repeated to the query heads before the exchange.
Refused at `initialize`, naming what: a model that is not a Hugging Face model with an
attention implementation to route, query heads not divisible by ``k``, and a model with a
sequence mixer that is not attention (a state-space or linear-attention layer, a convolution
along the sequence: each would mix its slice alone, silently).

A plain PyTorch model wraps its attention core in `SequenceParallelAttention` (one call, where
the model is built): the engine gives each such module its sequence group at `initialize`, and
the model's training forwards exchange around the core. Its loop splits the batch itself
(`sequence_slice`) and makes the loss the micro-batch's (`sequence_loss`), as DeepSpeed's
``DistributedAttention`` leaves both to the caller.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..comm import CollectiveKind, GroupComm
from ..sharding.gathering.agreement import Call, split_forward_facts
from .seam import MODEL, TransformTarget

IGNORE_INDEX = -100


class _AllToAll(torch.autograd.Function):
    """``tensor`` cut into ``k`` chunks along ``scatter_dim``, chunk ``j`` sent to group rank ``j``;
    the chunks received, in rank order, joined along ``gather_dim``. Backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, group: GroupComm, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return exchange(group, tensor, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        scatter_dim, gather_dim = ctx.dims
        return None, exchange(ctx.group, grad, gather_dim, scatter_dim), None, None


def exchange(group: GroupComm, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """The all-to-all itself, on the sequence group (no autograd)."""
    k = group.world_size
    send = torch.stack(tensor.chunk(k, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    group.all_to_all(send.view(-1), received.view(-1), CollectiveKind.ALL_TO_ALL).wait()
    # Freed here, before the join, not whenever the collective's own thread lets go of them.
    _free_storage(send)
    joined = torch.cat(received.unbind(0), dim=gather_dim)
    _free_storage(received)
    return joined


def _free_storage(tensor: torch.Tensor) -> None:
    """An exchange buffer's storage let go once the exchange completed (a test's NCCL model,
    whose waits return before the collective has, makes this do nothing)."""
    tensor.untyped_storage().resize_(0)


def all_to_all(group: GroupComm, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    return _AllToAll.apply(group, tensor, scatter_dim, gather_dim)


def whole_sequence_heads(group: GroupComm, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Each of ``(batch, heads, tokens/k, dim)`` exchanged into ``(batch, heads/k, tokens, dim)``:
    the whole sequence, this rank's heads. Key/value heads that ``k`` does not divide (fewer than
    ``k``) are first repeated to the query heads, so that each rank has its queries' own; the
    last value says whether they were."""
    repeated = bool(key.shape[1] % group.world_size)
    if repeated:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    query, key, value = (all_to_all(group, t, 1, 2) for t in (query, key, value))
    return query, key, value, repeated


class _FewerKeyValueGroups:
    """The attention module as the wrapped implementation sees it once the key/value heads were
    repeated to the query heads: one query head per key/value head."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self.num_key_value_groups = 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class SequenceParallelAttention(nn.Module):
    """A plain PyTorch model's attention core (``core(query, key, value, *args, **kwargs)``, the
    tensors ``(batch, heads, tokens, head_dim)`` as ``torch.nn.functional.scaled_dot_product_attention``
    takes them; its output in the query's layout), run over the whole sequence when the engine
    splits it: before the core, an all-to-all over the sequence group turns "my slice of the
    tokens, all heads" into "all tokens, my heads"; after it, back. Under no engine, with
    ``sequence_parallel_size`` 1, in evaluation and under ``no_grad``, the core as it is. Masks
    the core takes are the whole sequence's (``is_causal=True``, or ``tokens x tokens``)."""

    def __init__(self, core: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.core = core
        self._ulysses: UlyssesAttention | None = None  # the engine's transform, while it holds the model
        self._name = ""  # its name in the model, for messages (set by the transform)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        ulysses = self._ulysses
        if ulysses is None or not ulysses.active:
            return self.core(query, key, value, *args, **kwargs)
        k = ulysses.group.world_size
        if query.shape[1] % k:  # the same model on every rank: every rank raises here
            raise NotImplementedError(
                f"sequence_parallel_size = {k}: {self._name or 'a SequenceParallelAttention'} was called with "
                f"{query.shape[1]} query heads (dim 1 of query, (batch, heads, tokens, head_dim)), which do not split "
                f"over {k} ranks: each rank attends with heads / k of them"
            )
        query, key, value, _ = whole_sequence_heads(ulysses.group, query, key, value)
        return all_to_all(ulysses.group, self.core(query, key, value, *args, **kwargs), 2, 1)


def sequence_slice(group: GroupComm, tensor: torch.Tensor, dim: int = 1, pad_value: float = 0) -> torch.Tensor:
    """This rank's slice of a whole sequence's ``tensor`` along ``dim``, the sequence padded at
    its end with ``pad_value`` to a multiple of the group's size (labels: pad with -100)."""
    k = group.world_size
    if k == 1:
        return tensor
    length = tensor.shape[dim]
    padded = math.ceil(length / k) * k
    if padded != length:
        pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [0, padded - length]
        tensor = nn.functional.pad(tensor, pad, value=pad_value)
    return tensor.narrow(dim, group.rank * padded // k, padded // k).contiguous()


# A fused LM head's per-token outputs (TRL's `FusedCausalLMOutput`), gathered whole after a split forward.
PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


class _GatherSlices(torch.autograd.Function):
    """Every rank's slice joined along dim 1 (`gather_slices`); backward: this rank's slice of
    the gradient. Each rank computes the same loss from the whole, so its own slice's part is
    the gradient of its slice, and the group's gradients sum to the whole's."""

    @staticmethod
    def forward(ctx: Any, group: GroupComm, tensor: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.tokens = group, tensor.shape[1]
        return gather_slices(group, tensor, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        start = ctx.group.rank * ctx.tokens
        return None, grad[:, start : start + ctx.tokens].contiguous()


def gather_slices_with_gradient(group: GroupComm, tensor: torch.Tensor) -> torch.Tensor:
    """`gather_slices` along dim 1 through autograd where ``tensor`` needs a gradient."""
    if group.world_size == 1:
        return tensor
    if tensor.requires_grad:
        return _GatherSlices.apply(group, tensor)
    return gather_slices(group, tensor, 1)


def sequence_log_probs(group: GroupComm, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed log-probability of its targets, ``(batch,)``, from a rank's slice
    of the logits ``(batch, tokens / k, vocab)`` and of the targets (shifted before the split,
    -100 where none): the slice's sum, summed over the group; on every rank the whole
    sequence's value, the gradient of this rank's slice's (the group's gradients sum)."""
    valid = targets != IGNORE_INDEX
    token = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return whole_value(group, (token * valid).sum(dim=1))


def gather_slices(group: GroupComm, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Every rank's slice ``tensor`` of a sequence, joined along ``dim`` in group rank order
    (the inverse of `sequence_slice`, the end padding kept); no gradient."""
    k = group.world_size
    if k == 1:
        return tensor
    flat = torch.empty(k * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    group.own_shard(flat).copy_(tensor.reshape(-1))
    group.all_gather(flat, CollectiveKind.ALL_GATHER).wait()
    return torch.cat(flat.view(k, *tensor.shape).unbind(0), dim=dim)


def whole_value(group: GroupComm, loss: torch.Tensor) -> torch.Tensor:
    """``loss`` (a scalar, or a tensor of the same shape on every rank) whose value is summed
    over the sequence group (the micro-batch's, on every rank) and whose gradient stays this
    rank's (the group's gradients are summed)."""
    if group.world_size == 1:
        return loss
    total = loss.detach().clone()
    group.all_reduce_sum(total).wait()
    return loss + (total - loss.detach())


class UlyssesAttention:
    """``sequence_parallel_size`` on a Hugging Face model: its attention exchanged over the
    sequence group, its training micro-batches split along the sequence. On a plain PyTorch
    model: its `SequenceParallelAttention` modules given the group."""

    ORDER = MODEL

    def __init__(self, split_eval: bool = True) -> None:
        self.group = GroupComm(0, 1, "none")  # the sequence group, the target's (`apply`)
        self.split_eval = split_eval  # forwards without gradients split too (`sequence_parallel_eval`)
        self._target: TransformTarget | None = None  # the call agreement, the mesh (`apply`)
        self._leader = 0  # the global rank of the sequence group's first rank
        self.split_forwards = 0  # forwards of this micro-step split over the group (their rows sent)
        self._noted: torch.Tensor | None = None  # fingerprints of what a plain loop sliced since its last forward
        # Whether the last forward split its batch: its attention exchanges, and so does its
        # recomputation in backward (recompute_units), until the next forward decides again.
        self.active = False
        self._loss_pending = False  # the split forward's loss is still to be made the micro-batch's
        self._mask: torch.Tensor | None = None  # the split micro-batch's whole attention mask, if not causal alone
        self._tail = 0  # the pads the split added at the sequence's end (to a multiple of k)
        self._documents: list[list[int]] | None = None  # packed, unpadded: each row's document bounds
        self._windows_expected = False  # the config asks for sliding windows (`uses_sliding_windows`)
        self._windows_named = False  # some attention call of the split forward named its sliding_window
        # The split micro-batch's masks by (window, additive dtype), as the attention calls take them
        self._masks: dict[tuple[int | None, torch.dtype | None], torch.Tensor | None] = {}
        self._config: Any = None
        self._registry: Any = None  # transformers' attention registry (`_attention_registry`)
        self._name = ""
        self._previous_implementation: str | None = None
        self._handles: list[RemovableHandle] = []
        self._in_root = False  # inside a forward of the root (the model given to initialize)
        self._wrappers: list[SequenceParallelAttention] = []  # a plain model's attention cores

    @property
    def plain(self) -> bool:
        """Whether the model is a plain PyTorch one (its `SequenceParallelAttention` modules):
        its loop splits the batch and sums the loss."""
        return bool(self._wrappers)

    @property
    def loop_sums_loss(self) -> bool:
        """Whether the last forward was a plain model's split one: its loop makes the loss the
        micro-batch's (``engine.sequence_loss``), a Hugging Face model's forward does it here."""
        return self.active and bool(self._wrappers)

    def apply(self, target: TransformTarget) -> None:
        model = target.model
        self.group, self._target = target.group("sequence"), target
        self._leader = target.mesh.group_of("sequence", target.rank)[0]
        target.loop.on_micro_step_end(self._micro_step_ended)
        target.loop.on_exchanges_in_backward(lambda: self.split_forwards > 0)
        refuse_sequence_mixers(model, self.group.world_size)
        named = [(name, module) for name, module in model.named_modules()
                 if isinstance(module, SequenceParallelAttention)]
        self._wrappers = [module for _, module in named]
        if self._wrappers:  # a plain PyTorch model: its loop splits the batch
            for name, wrapper in named:
                wrapper._ulysses, wrapper._name = self, name
            self._handles = [model.register_forward_pre_hook(self._exchanging)]
            return
        self._config = check_model(model, self.group.world_size)
        self._windows_expected = uses_sliding_windows(self._config)
        self._registry, eager = _attention_registry(model)
        implementation = self._config._attn_implementation
        inner = self._registry[implementation] if implementation != "eager" else eager
        self._name = f"zero_engine_ulysses_{implementation}_{id(self)}"  # one per engine: each has its own group
        self._registry[self._name] = self._wrap(inner, causal_mask=implementation == "eager")
        self._previous_implementation = implementation
        self._config._attn_implementation = self._name
        self._handles = [
            model.register_forward_pre_hook(self._split, with_kwargs=True),
            model.register_forward_hook(self._whole_loss, always_call=True),
        ]
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        if base is not model:  # a wrapper's generate (PEFT's) calls the model it holds, past this root's hooks
            self._handles.append(base.register_forward_pre_hook(lambda module, args: _whole_past_root(self)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for wrapper in self._wrappers:
            wrapper._ulysses = None
        self._wrappers = []
        if self._previous_implementation is not None:
            self._config._attn_implementation = self._previous_implementation
            self._previous_implementation = None
            del self._registry[self._name]

    # -- the loop -------------------------------------------------------------------------

    def before_exchanges(self, batch: SplitBatch) -> None:
        """A split forward (training's, or evaluation's) exchanges over its sequence group, so
        each one sends a row of its own, read before its first exchange (at every stage): which
        split forward of the micro-step it is, and, compared within the sequence group, the
        micro-batch's shape and fingerprint. A collective call on some ranks only, an extra
        forward on one rank, or a group given different micro-batches then makes every rank
        raise `DivergedRanksError` at once, instead of one rank waiting in an exchange until
        the timeout (or the exchange joining halves of different sequences). The backward that
        follows sends its row before its first exchange too (`LoopHooks.exchanges_in_backward`)."""
        self.split_forwards += 1
        if self._target is not None:
            facts = split_forward_facts(self.split_forwards, self._leader, batch.batch, batch.tokens, batch.fingerprint)
            self._target.agree(Call.SPLIT_FORWARD, facts)

    def _micro_step_ended(self) -> None:
        self.split_forwards = 0

    def agree(self, call: Call) -> None:
        """A call row of the sequence loop's (`sequence_loop`), sent and read at once."""
        if self._target is not None:
            self._target.agree(call)

    # -- attention ------------------------------------------------------------------------

    def _wrap(self, inner: Any, causal_mask: bool) -> Any:
        def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
            if not self.active:
                return inner(module, query, key, value, attention_mask, *args, **kwargs)
            query, key, value, repeated = whole_sequence_heads(self.group, query, key, value)
            if repeated:
                module = _FewerKeyValueGroups(module)
            if self._documents is not None:  # packed, unpadded: each document attends alone, no mask of its size
                output = self._by_document(inner, module, query, key, value, causal_mask, args, kwargs)
            else:  # the whole sequence's mask, not the slice's: None where causal alone says it (sdpa)
                mask = self._attention_mask(kwargs.get("sliding_window"), query, additive=causal_mask)
                output, _ = inner(module, query, key, value, mask, *args, **kwargs)
            # (batch, tokens, heads/k, dim) -> (batch, tokens/k, heads, dim)
            return all_to_all(self.group, output, 1, 2), None

        return attention

    def _by_document(self, inner: Any, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     additive: bool, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
        """Packed documents without padding: the inner attention called on each document of each
        row alone (causal within it, or its band of a sliding window), its output ``(batch,
        tokens, heads, dim)`` joined. The same as the whole sequence's packed mask, with no mask
        of tokens x tokens (a 128K-token packed row's would be 16 GiB): each call's is its
        document's, causal alone none at all under ``sdpa``."""
        assert self._documents is not None
        window = kwargs.get("sliding_window")
        self._windows_named |= window is not None
        rows = []
        for row, bounds in enumerate(self._documents):
            pieces = []
            for start, end in zip(bounds[:-1], bounds[1:]):
                mask = self._document_mask(end - start, window, query, additive)
                part = (slice(row, row + 1), slice(None), slice(start, end))
                output, _ = inner(module, query[part], key[part], value[part], mask, *args, **kwargs)
                pieces.append(output)
            rows.append(torch.cat(pieces, dim=1))
        return torch.cat(rows, dim=0)

    def _document_mask(self, length: int, window: int | None, query: torch.Tensor,
                       additive: bool) -> torch.Tensor | None:
        """One document's mask as the inner attention takes it (None: causal alone, ``sdpa``),
        made once per split forward, length and kind."""
        key = (-length, window, query.dtype if additive else None)  # negative: apart from the whole's keys
        if key not in self._masks:
            mask = within_window(None, length, window, query.device) if window is not None else None
            if additive:  # eager: causal alone needs its mask too
                if mask is None:
                    mask = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
                mask = additive_mask(mask, query.dtype, 0)
            self._masks[key] = mask
        return self._masks[key]

    def _attention_mask(self, window: int | None, query: torch.Tensor, additive: bool) -> torch.Tensor | None:
        """The split micro-batch's whole-sequence mask for an attention call naming ``window``
        (or none), as the inner implementation takes it: boolean (or None) for ``sdpa``, added
        to the scores for ``eager``. Made once per split forward and kind, for every layer (and
        the recomputation in backward)."""
        key = (window, query.dtype if additive else None)
        if key not in self._masks:
            length, device = query.shape[2], query.device
            mask = self._mask
            if window is not None:
                self._windows_named = True
                mask = within_window(mask, length, window, device)
            if additive:  # eager: causal alone needs its tokens x tokens mask too
                if mask is None:
                    mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()
                mask = additive_mask(mask, query.dtype, self._tail)
            self._masks[key] = mask
        return self._masks[key]

    # -- the batch ------------------------------------------------------------------------

    def note_whole(self, tensor: torch.Tensor) -> None:
        """A plain model's loop sliced ``tensor`` (`sequence_slice`): its fingerprint goes into
        the next split forward's row, so that the ranks of a group are checked to have sliced
        the same micro-batch."""
        noted = fingerprint([tensor])
        self._noted = noted if self._noted is None else self._noted * _MIX + noted

    def _exchanging(self, module: nn.Module, args: tuple) -> None:
        """A plain model's forward: its attention cores exchange in training forwards (its loop
        gave it this rank's slice)."""
        self.active = module.training and torch.is_grad_enabled()
        if not self.active:
            return
        first = next((arg for arg in args if torch.is_tensor(arg)), None)
        shape = tuple(first.shape[:2]) if first is not None and first.dim() >= 2 else (0, 0)
        noted, self._noted = self._noted, None
        self.before_exchanges(SplitBatch(*shape, int(noted.item()) if noted is not None else 0))

    def _split(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self._in_root = True
        training = module.training and torch.is_grad_enabled()
        self.active = self._loss_pending = training or (self.split_eval and _evaluation(args, kwargs))
        if not self.active:
            return None
        self._masks, self._windows_named = {}, False
        kwargs = dict(kwargs)
        if len(args) > 1:
            raise NotImplementedError(
                "sequence_parallel_size: call the model with input_ids alone positional, the rest by name "
                "(labels=, attention_mask=, position_ids=), so that each is split as what it is"
            )
        if args:  # the model's positional order: input_ids first
            kwargs.setdefault("input_ids", args[0])
        input_ids = kwargs.get("input_ids")
        if input_ids is None:
            raise NotImplementedError("sequence_parallel_size: the model must be called with input_ids (not "
                                      "inputs_embeds) in training")
        batch, length = input_ids.shape
        k, rank = self.group.world_size, self.group.rank
        padded = math.ceil(length / k) * k
        given_positions, attention_mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
        positions = given_positions if given_positions is not None else torch.arange(length, device=input_ids.device)
        positions = positions.expand(batch, length)
        whole = [input_ids, kwargs.get("labels"), attention_mask, given_positions]
        facts = read_batch(whole, attention_mask, positions)
        self.before_exchanges(SplitBatch(batch, length, facts.fingerprint))  # before anything of the split
        self._tail = padded - length
        tail = torch.arange(1, padded - length + 1, device=positions.device)  # positions of the padding k needs
        positions = torch.cat([positions, positions[:, -1:] + tail], dim=1)
        # packed without padding: each document alone (no mask); else the whole sequence's mask, if any
        self._documents = document_bounds(positions) if facts.packed and not facts.padded else None
        self._mask = whole_sequence_mask(attention_mask, positions, padded, facts) if facts.padded else None
        ids = nn.functional.pad(input_ids, (0, padded - length))
        labels = kwargs.pop("labels", None)
        piece = slice(rank * padded // k, (rank + 1) * padded // k)
        split: dict[str, Any] = {
            "input_ids": ids[:, piece].contiguous(),
            "position_ids": positions[:, piece].contiguous(),
            "use_cache": False,
        }
        if labels is not None:
            shifted = nn.functional.pad(labels[:, 1:], (0, padded - length + 1), value=IGNORE_INDEX)
            mine = shifted[:, piece].contiguous()
            # A count the caller gives (a window's, as Hugging Face's Trainer gives it) is kept.
            counted = kwargs.get("num_items_in_batch", (shifted != IGNORE_INDEX).sum())
            split.update(labels=mine, shift_labels=mine, num_items_in_batch=counted)
        kwargs.pop("attention_mask", None)
        kwargs.pop("position_ids", None)
        kwargs.update(split)
        return (), kwargs

    def whole_sequence(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The last split forward's output ``tensor`` (its logits: the rank's slice along ``dim``)
        gathered over the sequence group into the whole micro-batch's, the split's end padding
        cut (no gradient: evaluation's metrics)."""
        whole = gather_slices(self.group, tensor.detach(), dim)
        return whole.narrow(dim, 0, whole.shape[dim] - self._tail)

    def _whole_loss(self, module: nn.Module, args: Any, output: Any) -> Any:
        """The loss's value made the micro-batch's on every rank of the group; its gradient
        stays this rank's slice's (the gradients of the group are summed)."""
        self._in_root = False
        if not self._loss_pending:
            return None
        self._loss_pending = False
        if self._windows_expected and not self._windows_named:
            raise NotImplementedError(
                f"sequence_parallel_size = {self.group.world_size}: {type(module).__name__}'s config asks for "
                f"sliding windows (sliding_window = {self._config.sliding_window}), but its attention calls name "
                "no sliding_window, so the exchanged attention cannot apply them: refused rather than trained as "
                "full causal attention"
            )
        self._whole_per_token(output)
        loss = getattr(output, "loss", None)
        if loss is None:
            return output
        output.loss = whole_value(self.group, loss)
        return output

    def _whole_per_token(self, output: Any) -> None:
        """A fused LM head's per-token outputs (TRL's ``fused_lm_head=True``: each next-token
        label's log-probability, entropy, ..., instead of the logits) gathered over the group into
        the whole micro-batch's, ``(batch, tokens - 1)`` as one process's (its labels unshifted),
        on every rank: a preference or RL loss takes each sequence's sum of them through a
        nonlinearity, which a slice's cannot give. The gradient of each rank's slice is its own
        part of the whole's (`_GatherSlices`): the group's gradients sum to the micro-batch's."""
        for name in PER_TOKEN:
            value = getattr(output, name, None)
            if torch.is_tensor(value) and value.dim() == 2:
                whole = gather_slices_with_gradient(self.group, value)
                setattr(output, name, whole[:, : whole.shape[1] - self._tail - 1])


def check_model(model: nn.Module, k: int) -> Any:
    """The model's config, if it is a model this transform can split; else `NotImplementedError`
    naming what it is not."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        raise NotImplementedError(
            f"sequence_parallel_size = {k}: {type(model).__name__} is not a Hugging Face model whose attention "
            f"implementation is 'sdpa' or 'eager' (found {implementation!r}), and has no "
            "zero_engine.SequenceParallelAttention module: wrap a plain PyTorch model's attention core in one"
        )
    if not is_causal_lm(model):
        raise NotImplementedError(
            f"sequence_parallel_size = {k}: {type(model).__name__} is not a Hugging Face causal language model "
            "(a *ForCausalLM, its attention causal): the split shifts the labels by one token and masks attention "
            "causally, which is right for a causal LM alone; an encoder (masked LM), a sequence classifier or a "
            "model with bidirectional attention would train something else. Train it without "
            "sequence_parallel_size, or wrap a plain model's attention core in zero_engine.SequenceParallelAttention "
            "and split its batch in the loop"
        )
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads % k:
        raise NotImplementedError(
            f"sequence_parallel_size = {k}: {type(model).__name__} has {heads} attention heads, which do not split "
            f"over {k} ranks"
        )
    return config


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` (or the model a PEFT wrapper holds) is a Hugging Face causal language
    model: a class transformers' causal-LM auto mapping names (read from the loaded module, so
    nothing here imports transformers; without it, a name ending in ``ForCausalLM``), whose
    config neither switches causality off (``is_causal``) nor, for an encoder family's LM head
    (``BertLMHeadModel``), leaves ``is_decoder`` off."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    name, config = type(base).__name__, getattr(base, "config", None)
    auto = sys.modules.get("transformers.models.auto.modeling_auto")
    names = getattr(auto, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", None)
    known = name in set(names.values()) if names is not None else name.endswith("ForCausalLM")
    if not known or getattr(config, "is_causal", True) is False:
        return False
    return name.endswith("ForCausalLM") or bool(getattr(config, "is_decoder", False))


# Sequence mixers that are not attention, by class name: state-space layers (Mamba, Mamba2, Jamba's
# and Falcon-H1's), linear attention and its kin (RWKV, RetNet, Gated DeltaNet), long convolutions.
NOT_ATTENTION = ("mamba", "ssm", "rwkv", "linearattention", "retention", "deltanet", "hyena", "shortconv")


def refuse_sequence_mixers(model: nn.Module, k: int) -> None:
    """`NotImplementedError` naming the first module that mixes tokens along the sequence other
    than by attention: split over ``k`` ranks, it would mix each slice alone."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, nn.Conv1d) or any(word in kind.lower() for word in NOT_ATTENTION):
            raise NotImplementedError(
                f"sequence_parallel_size = {k}: {name or 'the model'} ({kind}) mixes tokens along the sequence "
                "other than by attention (a state-space, linear-attention or convolution layer); split over ranks it "
                "would see only its slice, so it is refused rather than trained wrong"
            )


def uses_sliding_windows(model_config: Any) -> bool:
    """Whether a Hugging Face model's config asks some layer for a sliding window (``sliding_window`` set, not
    switched off by ``use_sliding_window``, and a sliding layer among ``layer_types`` if listed)."""
    window = getattr(model_config, "sliding_window", None)
    if window is None or getattr(model_config, "use_sliding_window", True) is False:
        return False
    layer_types = getattr(model_config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types


def within_window(mask: torch.Tensor | None, length: int, window: int, device: torch.device) -> torch.Tensor:
    """``mask`` (`whole_sequence_mask`'s, or None for causal alone) narrowed to the causal band
    of ``window`` keys over the whole sequence: query ``i`` sees key ``j`` when
    ``i - window < j <= i``, as Hugging Face's sliding-window mask says it."""
    queries = torch.arange(length, device=device)[:, None]
    keys = torch.arange(length, device=device)[None, :]
    band = (keys <= queries) & (keys > queries - window)
    return band[None, None] if mask is None else mask & band


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, tail: int) -> torch.Tensor:
    """``allowed`` as ``eager`` attention adds it to the scores: 0 where allowed, the dtype's
    minimum elsewhere, as Hugging Face's ``eager_mask`` makes it. A query with no key allowed
    (a left pad) then weighs every key alike, as in one process; the ``tail`` keys the split
    padded the sequence with get ``-inf`` where not allowed, so that such a query weighs the
    sequence's own keys alone, as one process's does."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    if tail:
        mask[..., -tail:].masked_fill_(~allowed[..., -tail:], float("-inf"))
    return mask


def _whole_past_root(split: UlyssesAttention) -> None:
    """The wrapped model called directly, not through the root (PEFT's ``generate`` after a
    split training step): its forward runs whole, not with the last split forward's state
    (which a recomputation in that forward's backward still needs, so it is kept until then):
    its attention would exchange and read that forward's masks."""
    if not split._in_root:
        split.active = False


def _evaluation(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a forward without gradients is one the split takes (``sequence_parallel_eval``):
    token ids alone positional or by name, no cache given or asked for. ``generate``'s forwards
    (a cache, ``use_cache=True``) and calls the split cannot read stay whole."""
    ids = args[0] if args else kwargs.get("input_ids")
    if len(args) > 1 or not torch.is_tensor(ids) or ids.dim() != 2:
        return False
    return kwargs.get("past_key_values") is None and not kwargs.get("use_cache", False)


class SplitBatch(NamedTuple):
    """What a split forward's row tells its sequence group before the first exchange: the
    micro-batch's shape (a plain model's: its slice's) and a fingerprint of what the group
    splits (`fingerprint`; 0 where nothing was seen whole)."""

    batch: int
    tokens: int
    fingerprint: int


class BatchFacts(NamedTuple):
    """What the split reads of a micro-batch on the host, in one read (one device sync)."""

    fingerprint: int
    packed: bool  # position_ids restart somewhere: documents packed in a row
    padded: bool  # an attention_mask with zeros

    @property
    def masked(self) -> bool:
        """Whether attention needs a mask beyond causal."""
        return self.packed or self.padded


_MIX = 1_000_003  # mixes each tensor's sum into the fingerprint (int64 arithmetic wraps alike everywhere)


def fingerprint(tensors: list[torch.Tensor | None], device: torch.device | None = None) -> torch.Tensor:
    """An int64 scalar (on ``device``, or the first tensor's) that differs, almost surely,
    between micro-batches of different contents: each integer tensor's elements weighted by
    their place, summed, and the sums mixed in order (a missing tensor counts as one). Wrapping
    int64 sums are exact and order-free, so every rank and device computes the same value for
    the same tensors."""
    if device is None:
        device = next(tensor.device for tensor in tensors if tensor is not None)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for tensor in tensors:
        if tensor is None:
            value = torch.ones((), dtype=torch.int64, device=device)
        else:
            flat = tensor.reshape(-1).to(device=device, dtype=torch.int64)
            value = (flat * torch.arange(1, flat.numel() + 1, device=device)).sum()
        total = total * _MIX + value
    return total


def read_batch(whole: list[torch.Tensor | None], attention_mask: torch.Tensor | None,
               positions: torch.Tensor) -> BatchFacts:
    """The fingerprint of the ``whole`` tensors, and whether the batch is packed or padded,
    read back together."""
    device = positions.device
    restarts = (positions[:, 1:] - positions[:, :-1] != 1).any()
    padded = (~attention_mask.bool()).any() if attention_mask is not None else torch.zeros((), dtype=torch.bool)
    values = [fingerprint(whole, device), restarts.long(), padded.long().to(device)]
    mark, packed, padding = torch.stack(values).tolist()
    return BatchFacts(mark, bool(packed), bool(padding))


def document_bounds(positions: torch.Tensor) -> list[list[int]]:
    """Each row's document boundaries, ``[0, start of the 2nd, ..., tokens]``: a document starts
    where ``position_ids`` step by other than +1 (Hugging Face's rule for packed sequences). One
    host read."""
    starts = torch.nonzero(positions[:, 1:] - positions[:, :-1] != 1).tolist()
    tokens = positions.shape[1]
    bounds: list[list[int]] = [[0] for _ in range(positions.shape[0])]
    for row, before in starts:
        bounds[row].append(before + 1)
    return [row + [tokens] for row in bounds]


def whole_sequence_mask(attention_mask: torch.Tensor | None, positions: torch.Tensor, padded: int,
                        facts: BatchFacts) -> torch.Tensor:
    """Which keys each query of the whole (padded) sequence may attend to, ``(batch, 1, padded,
    padded)``, as one process's model masks them under ``use_cache=False`` (Hugging Face's
    ``masking_utils``): causal; not at a padded key (``attention_mask`` zeros); and, when
    ``position_ids`` restart (packed documents: a step other than +1 starts a document), within
    the query's own document, so that each document attends as if run alone. Made only where
    `read_batch` found padding (``facts``): causal alone needs no mask of tokens x tokens, and
    packed rows without padding attend document by document (`UlyssesAttention._by_document`).

    A query with no key left (a left pad) keeps an empty row, as in one process: ``sdpa`` gives
    it zeros, ``eager`` the mean of every value (its additive mask is the same everywhere). Its
    output is read where the loss reads that position (the last pad predicts the first real
    token, labelled as collators label it), so it must be one process's. One process keeps
    documents apart only without an ``attention_mask``; the split keeps them apart whenever
    ``position_ids`` restart (with padding too), which is the documents run separately."""
    restarts = positions[:, 1:] - positions[:, :-1] != 1
    device = positions.device
    allowed = torch.ones(padded, padded, dtype=torch.bool, device=device).tril()[None]
    if facts.padded:
        assert attention_mask is not None
        valid = nn.functional.pad(attention_mask.bool(), (0, padded - attention_mask.shape[1]), value=False)
        allowed = allowed & valid[:, None, :]
    if facts.packed:  # the tail k pads continues the last document (its positions do), unread by the loss
        documents = nn.functional.pad(restarts.long().cumsum(1), (1, 0))  # the first token starts document 0
        documents = torch.cat([documents, documents[:, -1:].expand(-1, padded - documents.shape[1])], dim=1)
        allowed = allowed & (documents[:, :, None] == documents[:, None, :])
    return allowed[:, None]


def _attention_registry(model: nn.Module) -> tuple[Any, Any]:
    """Transformers' registry of attention implementations and the model's own eager attention,
    found in the modeling module of the model's attention layers (each Hugging Face model file
    imports the registry and defines its eager attention), so that nothing here imports
    transformers."""
    for module in model.modules():
        source = sys.modules.get(type(module).__module__)
        registry = getattr(source, "ALL_ATTENTION_FUNCTIONS", None)
        eager = getattr(source, "eager_attention_forward", None)
        if registry is not None and eager is not None:
            return registry, eager
    raise NotImplementedError(
        f"sequence_parallel_size: no Hugging Face modeling module (with ALL_ATTENTION_FUNCTIONS and "
        f"eager_attention_forward) found among {type(model).__name__}'s modules"
    )
