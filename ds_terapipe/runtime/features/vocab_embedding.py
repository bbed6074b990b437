"""The input embedding under vocabulary parallelism: its table split by vocabulary rows like the head's.

With a tied head (the output layer's weight is the input embedding's, ``TiedLayerSpec``), every pipeline rank
already holds rows ``[r*R, (r+1)*R)`` of that weight as its head shard (``runtime/features/vocab.py``), and the
input embedding uses the same shard: each shard's gradient is its rows' head gradient plus its rows' embedding
gradient, both local, and no gradient of the table is exchanged. With an untied head the embedding's own table is
split the same way (``module.vocab_embed``, an :class:`~.vocab_shard.EmbeddingShard` on every rank). Either way no
rank keeps the whole (V, H) table, and the first stage no longer carries its weights, optimizer state and dense
gradient alone.

How data flows, per unit (micro-batch b, slice i), as two more collectives of the pipeline's ranks, placed in
the schedule IR like ``VF``/``VB`` (``planner/vocab.py``; one order on every rank, ``replay`` proves it):

* ``EF(b,i)``, right before ``F(0,b,i)`` on the first stage: the first stage broadcasts the slice's token ids
  (B, T) (only the first and last stages read the data iterator, as in DeepSpeed's pipelines; ids are B*T
  integers per slice, cheaper than every rank reading the batch); each rank looks up the ids in its rows, zeros
  for the others, and the partial embeddings (B, T, H) are summed to the first stage (one reduce; each position
  has one non-zero term, so the sum is exactly the unsplit lookup). There the embedding module's token
  embedding (an ``nn.Embedding`` submodule, replaced by :class:`SplitTokenEmbedding`) returns that sum, a leaf
  of the graph; everything else of the layer (position embeddings, dropout) runs on the first stage as before.
* ``EB(b,i)``, right after ``B(0,b,i)``: the leaf's gradient (B, T, H) (complete: later slices' backwards ran
  first and carried their cache gradients into this one) is broadcast, and each rank adds it into its rows of
  the shard's gradient (``index_add``). DeepSpeed's backward already divided it by the gradient accumulation
  steps; ``padding_idx`` positions add nothing, as ``nn.Embedding``'s.

Outside the schedule (the slice check and profiling at engine init, the re-planner) the split embedding looks up
this rank's rows alone (no collective, no gradient): same shapes and cost, which is all those need.

When it applies (decided from the layer specs, the same on every rank). Tied: the head is a ``TiedLayerSpec``
whose key one other layer uses, on the first stage, and the tied weight is ``<path>.weight`` of an ``nn.Embedding``
without ``max_norm``, ``scale_grad_by_freq`` or ``sparse``; otherwise the input embedding stays whole on its holder
and ``ReduceTiedGrads`` exchanges the (V, H) gradient (logged as a warning). Untied: layer 0 looks its input up in
one such ``nn.Embedding`` of the head's (V, H) shape (the one that receives the input tensor itself when the layer
runs on the meta device: structure, not class names) and shares no weight with a later layer; otherwise it stays
whole on the first stage (logged at info: correct, only unbalanced).

Checkpoints: the first stage's layer file no longer holds the token table; the shards do (tied: the head's rows
with the embedding's layer index; untied: the embedding's rows, its layer and name), so ``export_state_dict``
returns the whole table under the embedding's layer index and any p loads it. A checkpoint written without the
split loads its rows from the embedding's layer file.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import TiedLayerSpec

from ..slicing.context import current_slice, cut_tokens, slice_scope
from ..execution.stage import PipelineStage
from .vocab_shard import HeadSpec, VocabRows, get_dotted

__all__ = ["EmbeddingSplit", "SplitTokenEmbedding", "VocabEmbedding", "plan_embedding_split", "install_split",
           "lookup_rows", "split_owner"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddingSplit:
    """Where the split input embedding is: its layer index, the ``nn.Embedding``'s path inside the layer's module
    (``"wte"``, ``"embed_tokens"``) and its state-dict name there (``"wte.weight"``); ``tied``: it shares the
    head's rows (else its own :class:`~.vocab_shard.EmbeddingShard`); ``key``: the ``TiedLayerSpec`` key whose
    module holds it (the head's key when tied; the layer's own when an untied embedding layer is a
    ``TiedLayerSpec`` no other layer uses), None for a plain layer."""

    key: Optional[str]
    layer: int
    path: str
    padding_idx: Optional[int]
    tied: bool = True

    @property
    def name(self) -> str:
        return f"{self.path}.weight"


def plan_embedding_split(full: torch.nn.Module, spec: "HeadSpec", specs: list, stage_owner: Any,
                         shape: tuple[int, int]) -> Optional[EmbeddingSplit]:
    """The split of the input embedding, or None where it stays whole (see the module docstring).

    ``full`` is the output layer as built from its spec, ``shape`` its weight's (V, H), ``specs`` the layers
    without the head, ``stage_owner(layer)`` the stage of a layer. Depends on the specs only: every rank decides
    the same."""
    if spec.tied_key is None:
        return _plan_untied(specs, shape)
    users = [i for i, s in enumerate(specs) if isinstance(s, TiedLayerSpec) and s.key == spec.tied_key]
    path, _, attr = spec.weight_name.rpartition(".")
    embedding = get_dotted(full, path) if path else None
    why = None
    if len(users) != 1:
        why = f"the tied weight is used by layers {users} besides the head (one input embedding is split)"
    elif stage_owner(users[0]) != 0:
        why = f"the input embedding (layer {users[0]}) is not on the first stage"
    elif specs[users[0]].typename is not getattr(spec.layer, "typename", None):
        why = "the embedding's and the head's TiedLayerSpec build different modules"
    elif attr != "weight" or not isinstance(embedding, torch.nn.Embedding):
        why = (f"the tied weight {spec.weight_name!r} is not the weight of an nn.Embedding submodule of the tied "
               "module")
    elif not _plain(embedding):
        why = "its nn.Embedding uses max_norm, scale_grad_by_freq or sparse"
    if why is not None:
        logger.warning("terapipe: vocab parallel: the input embedding stays whole on its stage (its gradient is "
                       "exchanged in ReduceTiedGrads): %s", why)
        return None
    return EmbeddingSplit(spec.tied_key, users[0], path, embedding.padding_idx)


def _plain(embedding: torch.nn.Embedding) -> bool:
    """Whether a lookup of its rows is all it does (EF looks rows up, EB adds their gradient): no renormalising
    (``max_norm``), no frequency scaling, dense gradients."""
    return embedding.max_norm is None and not embedding.scale_grad_by_freq and not embedding.sparse


def _plan_untied(specs: list, shape: tuple[int, int]) -> Optional[EmbeddingSplit]:
    """The untied input embedding's split: layer 0 looks its input up in one ``nn.Embedding`` of the head's
    (V, H) shape (found by running the layer once on the meta device and seeing which embedding receives the
    input tensor itself: structure, not class names), plain (no max_norm, scale_grad_by_freq, sparse)."""
    if not specs:
        return None
    first, why, found = specs[0], None, None
    key = first.key if isinstance(first, TiedLayerSpec) else None
    others = [i for i, s in enumerate(specs) if i and key is not None and isinstance(s, TiedLayerSpec) and s.key == key]
    if others:
        why = f"layer 0 shares its weights with layers {others} (TiedLayerSpec {key!r})"
    else:
        found, why = _token_embedding(first)
    if found is not None:
        path, embedding = found
        if (embedding.num_embeddings, embedding.embedding_dim) != tuple(shape):
            why = (f"its token embedding {path!r} is {embedding.num_embeddings} x {embedding.embedding_dim}, the "
                   f"output layer {shape[0]} x {shape[1]}")
        elif not _plain(embedding):
            why = f"its token embedding {path!r} uses max_norm, scale_grad_by_freq or sparse"
        else:
            return EmbeddingSplit(key, 0, path, embedding.padding_idx, tied=False)
    logger.info("terapipe: vocab parallel: the untied input embedding stays whole on the first stage: %s", why)
    return None


def _token_embedding(layer: Any) -> tuple[Optional[tuple[str, torch.nn.Embedding]], str]:
    """((path, module) of the ``nn.Embedding`` that ``layer`` (a LayerSpec or module) looks its input up in, or
    None; why not). A spec is built and run on the meta device (no memory, no initialisation); a module given
    as such runs once in eval mode on its own device, without gradient."""
    try:
        if isinstance(layer, torch.nn.Module):
            module = layer
            device = next(iter(module.parameters()), torch.zeros(0)).device
        else:
            with torch.device("meta"):
                module = layer.build()
            device = torch.device("meta")
        embeddings = {name: m for name, m in module.named_modules() if isinstance(m, torch.nn.Embedding)}
        if not embeddings:
            return None, "layer 0 has no nn.Embedding"
        ids = torch.zeros((1, 2), dtype=torch.int64, device=device)
        called: list[str] = []
        hooks = [m.register_forward_pre_hook(
            lambda _m, args, name=name: called.append(name) if args and args[0] is ids else None)
            for name, m in embeddings.items()]
        training = module.training
        module.eval()   # no dropout: the probe draws nothing from any device's random stream
        try:
            fn = getattr(layer, "forward_fn", None)
            with torch.no_grad(), torch.random.fork_rng(devices=[]), slice_scope(None):
                fn(module, ids) if fn is not None else module(ids)
        finally:
            module.train(training)
            for hook in hooks:
                hook.remove()
    except Exception as err:  # noqa: BLE001 - a layer that cannot be probed keeps its embedding whole
        return None, f"layer 0 could not be run on token ids to find its token embedding ({type(err).__name__}: {err})"
    if len(called) != 1:
        return None, (f"layer 0 looks its input up in {len(called)} nn.Embedding modules {called} (one token "
                      "embedding is split)")
    return (called[0], embeddings[called[0]]), ""


def lookup_rows(head: "VocabRows", ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This shard's part of the embedding of ``ids`` (B, T): (partial (B, T, H), zeros where another shard holds
    the token; row index into the shard (B, T); in-shard mask (B, T))."""
    local = ids.to(torch.int64) - head.offset
    mask = (local >= 0) & (local < head.num_valid)
    local = torch.where(mask, local, torch.zeros_like(local))
    part = F.embedding(local, head.weight).masked_fill(~mask.unsqueeze(-1), 0.0)  # (B, T, H)
    return part, local, mask


class SplitTokenEmbedding(torch.nn.Module):
    """Stands in for the first stage's token ``nn.Embedding``: returns what ``EF`` summed for the running unit.

    Holds no parameter (the rows are ``vocab_head``'s, on every rank); its state dict is empty, and a checkpoint
    written without the split (which has the table here) loads without complaint (the shard takes its rows)."""

    def __init__(self, original: torch.nn.Embedding, head: "VocabRows") -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = original.num_embeddings, original.embedding_dim
        self.padding_idx = original.padding_idx
        self._head = (head, )  # a tuple: not a submodule, its parameters stay the shard's (vocab_head, vocab_embed)
        # (micro-batch, slice) -> (token ids (B, T), summed embedding (B, T, H), kept after use)
        self.pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, bool]] = {}
        self.live = False  # while the engine runs a schedule: every forward is a unit's, EF ran before it

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}: split by vocabulary rows over the pipeline "
                "(rows of vocab_head)")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.live:  # the slice check, profiling: this rank's rows, no gradient
            with torch.no_grad():
                return lookup_rows(self._head[0], ids)[0]
        ctx = current_slice()
        key = None if ctx is None else (ctx.microbatch, ctx.slice_index)
        entry = self.pending.get(key) if key is not None else None
        assert entry is not None, f"the split embedding ran for unit {key} without its EF pass"
        want, embedded, keep = entry
        if not keep:
            del self.pending[key]
        if not torch.is_grad_enabled():  # a frozen layer's use: nothing flows back into the rows (EB adds zeros)
            embedded = embedded.detach()
        if tuple(ids.shape) != tuple(want.shape) or not torch.equal(ids.to(want.dtype), want):
            raise ValueError("terapipe.vocab_parallel: the tied input embedding is called with other token ids than "
                             "the batch's inputs of this slice (the first layer must look up the inputs it receives); "
                             "make the embedding layer the first layer, taking the token ids (B, T), or set "
                             "terapipe.vocab_parallel to false")
        return embedded

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        """The table a checkpoint may hold here is loaded into the shards (``load_vocab_shard``), not here."""


def split_owner(module: Any, split: EmbeddingSplit) -> Optional[torch.nn.Module]:
    """The module that holds the split embedding on this rank (its layer's, or the tied key's), else None."""
    if split.key is not None:
        return module.tied_modules[split.key] if split.key in module.tied_modules else None
    return module._modules.get(str(split.layer))


def install_split(module: Any, table: "VocabRows", split: EmbeddingSplit) -> None:
    """Replace the token embedding with :class:`SplitTokenEmbedding` (looking up in ``table``: the head's rows,
    or the untied embedding's) on the stage that holds it, and take its tied key out of DeepSpeed's tied-weight
    exchange (the head, its only other user, is split; an untied embedding's key has no other user)."""
    owner = split_owner(module, split)
    if owner is not None:
        parent_path, _, name = split.path.rpartition(".")
        parent = get_dotted(owner, parent_path) if parent_path else owner
        setattr(parent, name, SplitTokenEmbedding(getattr(parent, name), table))
    if split.key is not None:
        module.tied_comms.pop(split.key, None)


class VocabEmbedding:
    """The engine's side: the ``EF``/``EB`` passes (see the module docstring)."""

    def __init__(self, engine: "PipelineStage", table: "VocabRows", split: EmbeddingSplit) -> None:
        self.engine, self.table, self.split = engine, table, split
        self.group = engine.grid.get_pipe_parallel_group()
        first = engine.placement[0]  # the rank of chunk 0 (rank 0 in every placement)
        self.src = engine.grid.stage_to_global(first)
        self.is_first = engine.stage_id == first
        self.stub: Optional[SplitTokenEmbedding] = None
        if self.is_first:
            self.stub = get_dotted(split_owner(engine.module, split), split.path)
            assert isinstance(self.stub, SplitTokenEmbedding), "install_split ran at build"
        # (micro-batch, slice) -> (row index into the shard (B, T), counted mask (B, T)) until EB
        self._units: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.grads = engine.grad_sink

    def reset(self) -> None:
        self._units.clear()
        if self.stub is not None:
            self.stub.pending.clear()

    @contextmanager
    def live(self) -> Iterator[None]:
        """While a schedule runs: the first stage's embedding serves what EF summed."""
        if self.stub is not None:
            self.stub.live = True
        try:
            yield
        finally:
            if self.stub is not None:
                self.stub.live = False

    def forward_pass(self, microbatch: int, slice_index: int) -> None:
        engine = self.engine
        start, end = engine.token_bounds(slice_index, microbatch)   # this rank's share under sequence parallelism
        shape = (engine.micro_batch_size, end - start)
        what = f"the vocabulary embedding of micro-batch {microbatch} slice {slice_index}"
        training = torch.is_grad_enabled()
        if self.is_first:
            inputs = cut_tokens(engine.loaded[microbatch]["inputs"], start, end, engine.seq_len_of(microbatch))
            ids = inputs
            if not torch.is_tensor(ids) or ids.is_floating_point() or tuple(ids.shape) != shape:
                got = tuple(ids.shape) if torch.is_tensor(ids) else type(ids).__name__
                raise ValueError(f"terapipe.vocab_parallel splits the input embedding: the batch's "
                                 f"inputs must be token ids, an integer tensor (micro-batch, seq_len), got {got}; "
                                 "pass the ids alone as inputs, or set terapipe.vocab_parallel to false")
            ids = ids.to(torch.int64).contiguous()
        else:
            ids = torch.empty(shape, dtype=torch.int64, device=engine.device)
        self._wait([dist.broadcast(ids, self.src, group=self.group, async_op=True)], what)
        with torch.no_grad():
            part, local, mask = lookup_rows(self.table, ids)
        self._wait([dist.reduce(part, self.src, group=self.group, async_op=True)], what)
        if training:
            counted = mask if self.split.padding_idx is None else mask & (ids != self.split.padding_idx)
            self._units[(microbatch, slice_index)] = (local, counted)
        if self.stub is not None:
            self.stub.pending[(microbatch, slice_index)] = (ids, part.requires_grad_(training), training)

    def backward_pass(self, microbatch: int, slice_index: int) -> None:
        engine, table = self.engine, self.table
        local, counted = self._units.pop((microbatch, slice_index))
        if not table.weight.requires_grad:
            # a frozen untied table (layer 0 frozen, on every rank alike): no gradient to hand out, no collective
            if self.stub is not None:
                self.stub.pending.pop((microbatch, slice_index), None)
            return
        if self.stub is not None:
            _, embedded, _ = self.stub.pending.pop((microbatch, slice_index))
            grad = embedded.grad if embedded.grad is not None else torch.zeros_like(embedded)
            grad = grad.to(table.weight.dtype).contiguous()
        else:
            grad = torch.empty((*local.shape, table.weight.shape[1]), dtype=table.weight.dtype, device=engine.device)
        self._wait([dist.broadcast(grad, self.src, group=self.group, async_op=True)],
                   f"the vocabulary embedding backward of micro-batch {microbatch} slice {slice_index}")
        with torch.no_grad():
            self.grads.index_add(table.weight, local[counted], grad[counted].float())

    def _wait(self, works: list, what: str) -> None:
        self.engine.p2p.wait_all(works, what, self.group)
