"""Vocabulary parallelism (``terapipe.vocab_parallel``): the output layer split by vocabulary rows over the p
ranks of a pipeline, so the last stage no longer carries the (hidden x vocab) GEMM, the softmax and the head's
weights, gradients and optimizer state alone.

How data flows (every schedule; "the last stage" is the rank the placement puts the last chunk on: the last rank
with one chunk per rank or the looped placement, rank 0 under ``dualpipev``'s V):

* Build: :class:`~ds_terapipe.runtime.execution.module.TokenPipelineModule` (``vocab_parallel=True``) takes the output
  layer (the last of ``layers``: an ``nn.Linear``, a module holding one (V, H) matrix and at most a bias of V,
  such as a Hugging Face ``lm_head`` wrapper, or a ``TiedLayerSpec`` whose forward is ``x @ W.T`` with its tied
  weight, as the reference GPT's; each checked to compute ``x @ W.T + b``) out of the layers DeepSpeed
  partitions (into chunks, with virtual stages),
  and every rank r holds
  :class:`VocabShardHead`: rows ``[r*R, (r+1)*R)`` of the weight (and bias), ``R = ceil(V/p)``; rows past V are
  padding, masked out of every softmax. Initial rows are broadcast from the rank whose weight is the truth (the
  tied embedding's holder, else the last chunk's rank), so the sharded model starts as the unsharded one.
* ``VF(b,i)`` (after the last chunk's ``F``; every rank, one order: ``planner/vocab.py``): the last chunk's
  output, the final hidden states h (B, T, H), and the labels (B, T) are broadcast; each rank computes its
  logits (B, T, R), the max is all-reduced (MAX), then the sum of exponentials and the target logit (SUM): the
  loss is the unsharded cross entropy (``causal_lm_loss``: sum over counted tokens / label positions, weighted
  by the slice's share of the tokens). DeepSpeed's forward on the last stage computes a placeholder loss, which
  VF fills in (so the step's reported loss is the real one).
* ``VB(b,i)`` (before the last chunk's ``B``): each rank turns its logits into d loss / d logits
  (softmax - one-hot, times the token weight), adds its shard's weight gradient (divided by the gradient
  accumulation steps, as DeepSpeed's backward divides the loss) and reduces its part of d loss / d h to the last
  stage, whose ``B`` then backpropagates ``sum(h * dh)``.
* Tied weights (``ReduceTiedGrads``): the embedding's gradient (full, on its holder) and the shards' gradients
  are summed into one (V, H) gradient over the pipeline; the holder keeps all of it, each shard its rows, so
  both copies of every row take the same optimizer step. That is the fallback: where it can
  (``runtime/features/vocab_embedding.py``), the tied input embedding is split with the head, uses the same shard
  (passes ``EF``/``EB``), no rank keeps the whole table and nothing is exchanged here. An untied input embedding
  is split the same way with rows of its own (:func:`build_embedding_shard`: ``module.vocab_embed``).
* Checkpoints: each pipeline rank writes its shard (``vocab_shard-RR-of-PP-model_states.pt``) next to
  DeepSpeed's layer files; loading concatenates all shards and keeps this rank's rows, so any p loads the
  weights (optimizer state: the same p only, as for layers). A checkpoint written without vocabulary
  parallelism loads from the head's (or the tied embedding's) layer file; a model without vocabulary
  parallelism loads the head (and a split embedding's table) from the shards (:func:`layer_fills`).

Precision: the shards' gradients are computed in fp32 and go where each DeepSpeed optimizer reads them
(runtime/execution/grad_sink.py), so bf16, fp16 and ZeRO 1 train as fp32 does.

Refused at build or engine init, on every rank, with the rule and the fix: no recognisable output layer, a loss
other than ``causal_lm_loss``, a vocabulary smaller than p.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import TiedLayerSpec

from ..execution.batch_checks import IGNORE_INDEX, out_of_range_ids
from ..execution.errors import CheckpointError
from ..execution.stage import PipelineStage
from ..slicing.context import current_slice
from .vocab_embedding import EmbeddingSplit, VocabEmbedding, plan_embedding_split, split_owner
from .vocab_shard import EmbeddingShard, HeadSpec, VocabShardHead, build_full, get_dotted


__all__ = ["VocabParallel", "build_shard_head", "build_embedding_shard", "save_vocab_shard", "load_vocab_shard",
           "shard_file_name",
           "merge_vocab_shards", "layer_fills"]

logger = logging.getLogger(__name__)

_SHARD_FILE = re.compile(r"vocab_shard-(\d+)-of-(\d+)-model_states\.pt$")
def shard_file_name(rank: int, num_shards: int) -> str:
    return f"vocab_shard-{rank:02d}-of-{num_shards:02d}-model_states.pt"


def build_shard_head(module: Any, spec: HeadSpec) -> VocabShardHead:
    """Every rank's shard, called by TokenPipelineModule after DeepSpeed built (and placed) its layers: the full
    output layer is built on every rank, the rank holding the true weight broadcasts it, each keeps its rows."""
    p, stage = module.num_stages, module.stage_id
    from ...models.gpt import causal_lm_loss  # models build on runtime: imported when needed

    if module.loss_fn is not causal_lm_loss:
        raise ValueError(f"terapipe.vocab_parallel needs the token-wise cross entropy "
                         f"ds_terapipe.models.gpt.causal_lm_loss as loss_fn (the sharded softmax computes exactly it), "
                         f"got {module.loss_fn!r}; pass loss_fn=causal_lm_loss or set vocab_parallel to false")
    full, weight, bias = build_full(spec)
    split = plan_embedding_split(full, spec, module._layer_specs, module.stage_owner, tuple(weight.shape))
    del full
    vocab = weight.shape[0]
    if vocab < p:
        raise ValueError(f"terapipe.vocab_parallel: vocabulary {vocab} < {p} pipeline stages; every rank needs at "
                         "least one row: use fewer stages or set vocab_parallel to false")
    device = next(iter(module.parameters()), weight).device
    weight, bias = weight.to(device).clone(), None if bias is None else bias.to(device).clone()
    source = module.placement[-1]  # the last chunk's rank: where the head would be without vocabulary parallelism
    if spec.tied_key is not None:
        source = min(module.stage_owner(i) for i, s in enumerate(module._layer_specs)
                     if isinstance(s, TiedLayerSpec) and s.key == spec.tied_key)
        if stage == source:
            weight = get_dotted(module.tied_modules[spec.tied_key], spec.weight_name).detach().clone()
    if p > 1:
        group, src = module._grid.get_pipe_parallel_group(), module._grid.stage_to_global(source)
        dist.broadcast(weight, src, group=group)
        if bias is not None:
            dist.broadcast(bias, src, group=group)
    head = VocabShardHead(torch.zeros(0, weight.shape[1]), None, vocab, stage, p, spec)
    with torch.no_grad():
        head.weight = torch.nn.Parameter(head.take_rows(weight))
        head.bias = None if bias is None else torch.nn.Parameter(head.take_rows(bias))
    head.embedding = split
    if spec.tied_key is not None and split is None:
        # Its gradient is a copy of the tied embedding's rows after ReduceTiedGrads: counted once in norms (there).
        for param in head.parameters():
            param.ds_pipe_replicated = True
    logger.info("terapipe: vocab parallel: stage %d holds %s%s", stage, head.extra_repr(),
                "" if split is None or not split.tied else f"; the input embedding (layer {split.layer}) uses them too")
    return head


def build_embedding_shard(module: Any, split: EmbeddingSplit) -> EmbeddingShard:
    """Every rank's rows of the untied input embedding (before ``install_split`` replaces it): the first stage,
    which built the layer, broadcasts its table, each rank keeps its rows (the split model starts as the whole)."""
    p, stage = module.num_stages, module.stage_id
    source = module.placement[0]   # chunk 0's rank holds layer 0
    head = module.vocab_head       # the split checked the table is (V, H) like the head; it travels in its dtype
    if stage == source:
        table = get_dotted(split_owner(module, split), split.path).weight.detach().to(head.weight).clone()
    else:
        table = torch.empty((head.vocab_size, head.weight.shape[1]), dtype=head.weight.dtype, device=head.weight.device)
    if p > 1:
        dist.broadcast(table, module._grid.stage_to_global(source), group=module._grid.get_pipe_parallel_group())
    shard = EmbeddingShard(table[:0], table.shape[0], stage, p)
    with torch.no_grad():
        shard.weight = torch.nn.Parameter(shard.take_rows(table))
    logger.info("terapipe: vocab parallel: stage %d holds %s of the input embedding (layer %d, %s)", stage,
                shard.extra_repr(), split.layer, split.name)
    return shard


# -- checkpoints --------------------------------------------------------------------------------------------
def save_vocab_shard(module: Any, save_dir: str) -> None:
    """Write this pipeline rank's shard (data-parallel rank 0 only, as DeepSpeed writes layers; under sequence
    parallelism the first sequence rank only: the others hold the same rows under the same file name)."""
    head: VocabShardHead = module.vocab_head
    if module._grid.data_parallel_id != 0 or module._grid.get_slice_parallel_rank() != 0:
        return
    os.makedirs(save_dir, exist_ok=True)
    split = head.embedding
    state = {"weight": head.weight.detach().cpu(), "vocab_size": head.vocab_size, "layer": head.spec.index,
             "weight_name": head.spec.weight_name,
             "embedding_layers": [split.layer] if split is not None and split.tied else []}
    if head.bias is not None:
        state["bias"] = head.bias.detach().cpu()
    if split is not None and not split.tied:   # the untied input embedding's rows: its table, under its own name
        state["embedding"] = {"weight": module.vocab_embed.weight.detach().cpu(), "layer": split.layer,
                              "name": split.name}
    torch.save(state, os.path.join(save_dir, shard_file_name(head.rank, head.num_shards)))


def merge_vocab_shards(tag_dir: str) -> Optional[dict[str, Any]]:
    """The full (V, H) weight (and bias) from every shard file of a checkpoint, or None if it has none."""
    found = {}
    for path in glob.glob(os.path.join(tag_dir, "vocab_shard-*-model_states.pt")):
        match = _SHARD_FILE.search(os.path.basename(path))
        if match:
            found[int(match.group(1))] = (int(match.group(2)), path)
    if not found:
        return None
    counts = {n for n, _ in found.values()}
    if len(counts) != 1 or sorted(found) != list(range(counts.pop())):
        raise CheckpointError(f"checkpoint {tag_dir} has vocabulary shards {sorted(found)} of "
                              f"{sorted({n for n, _ in found.values()})}: incomplete; load an earlier tag")
    parts = [torch.load(found[r][1], map_location="cpu", weights_only=True) for r in sorted(found)]
    vocab = parts[0]["vocab_size"]
    out = {"weight": torch.cat([s["weight"] for s in parts])[:vocab], "vocab_size": vocab,
           "layer": parts[0]["layer"], "weight_name": parts[0]["weight_name"],
           "embedding_layers": list(parts[0].get("embedding_layers", []))}
    if "bias" in parts[0]:
        out["bias"] = torch.cat([s["bias"] for s in parts])[:vocab]
    if "embedding" in parts[0]:
        out["embedding"] = dict(parts[0]["embedding"],
                                weight=torch.cat([s["embedding"]["weight"] for s in parts])[:vocab])
    return out


def load_vocab_shard(module: Any, load_dir: str) -> None:
    """Load this rank's rows from the shards of any p, or from the head's layer file of a run without them."""
    head: VocabShardHead = module.vocab_head
    merged = merge_vocab_shards(load_dir)
    if merged is None:
        # the head's layer file, or (a tied head has none) the tied embedding's: the table is there
        layers = [head.spec.index] + ([] if head.spec.tied_key is None else
                                      [i for i, s in enumerate(module._layer_specs)
                                       if isinstance(s, TiedLayerSpec) and s.key == head.spec.tied_key])
        files = [os.path.join(load_dir, f"layer_{i:02d}-model_states.pt") for i in layers]
        layer_file = next((f for f in files if os.path.exists(f)), None)
        if layer_file is None:
            raise CheckpointError(f"checkpoint {load_dir} has neither vocabulary shards nor the output layer's file "
                                  f"{os.path.basename(files[0])}; it was written for another model")
        saved = torch.load(layer_file, map_location="cpu", weights_only=True)
        merged = {"weight": saved[head.spec.weight_name]}
        if head.spec.bias_name and head.spec.bias_name in saved:
            merged["bias"] = saved[head.spec.bias_name]
    weight = merged["weight"]
    if tuple(weight.shape) != (head.vocab_size, head.weight.shape[1]):
        raise CheckpointError(f"checkpoint {load_dir}: the output layer is {tuple(weight.shape)}, this model's "
                              f"({head.vocab_size}, {head.weight.shape[1]}); build the model with its dimensions")
    with torch.no_grad():
        head.weight.copy_(head.take_rows(weight.to(head.weight.device)))
        if head.bias is not None and "bias" in merged:
            head.bias.copy_(head.take_rows(merged["bias"].to(head.bias.device)))
    if getattr(module, "vocab_embed", None) is not None:
        _load_embedding_shard(module, load_dir, merged)


def _load_embedding_shard(module: Any, load_dir: str, merged: dict[str, Any]) -> None:
    """The untied input embedding's rows: from the shards that hold its table, else from its layer file (a
    checkpoint written without vocabulary parallelism, or with the embedding whole)."""
    shard: EmbeddingShard = module.vocab_embed
    split: EmbeddingSplit = module.vocab_head.embedding
    table = merged.get("embedding", {}).get("weight")
    if table is None:
        layer_file = os.path.join(load_dir, f"layer_{split.layer:02d}-model_states.pt")
        saved = torch.load(layer_file, map_location="cpu", weights_only=True) if os.path.exists(layer_file) else {}
        if split.name not in saved:
            raise CheckpointError(f"checkpoint {load_dir} has the input embedding's table ({split.name} of layer "
                                  f"{split.layer}) neither in its vocabulary shards nor in its layer file; it was "
                                  "written for another model")
        table = saved[split.name]
    if tuple(table.shape) != (shard.vocab_size, shard.weight.shape[1]):
        raise CheckpointError(f"checkpoint {load_dir}: the input embedding is {tuple(table.shape)}, this model's "
                              f"({shard.vocab_size}, {shard.weight.shape[1]}); build the model with its dimensions")
    shard.fill_rows(table)


def layer_fills(tag_dir: str) -> dict[int, dict[str, torch.Tensor]]:
    """What a checkpoint written with vocabulary parallelism holds in its shards rather than in layer files, per
    layer index: the head's weight (and bias), and the split input embedding's table. A model without vocabulary
    parallelism loads them from here (``TokenPipelineModule.load_state_dir``); empty without shards."""
    merged = merge_vocab_shards(tag_dir)
    if merged is None:
        return {}
    head = {merged["weight_name"]: merged["weight"]}
    if "bias" in merged:
        head["bias"] = merged["bias"]
    out = {merged["layer"]: head}
    for layer in merged["embedding_layers"]:
        out[layer] = {merged["weight_name"]: merged["weight"]}
    if "embedding" in merged:
        embedding = merged["embedding"]
        out.setdefault(embedding["layer"], {})[embedding["name"]] = embedding["weight"]
    return out


# -- the passes ---------------------------------------------------------------------------------------------
@dataclass
class _Unit:
    """What VB of one (micro-batch, slice) needs from its VF."""

    hidden: torch.Tensor    # (B, T, H), detached
    logits: torch.Tensor    # (B, T, R) fp32, padded rows -inf
    lse: torch.Tensor       # (B, T) log-sum-exp over the whole vocabulary
    index: torch.Tensor     # (B, T) label - offset, clamped into the shard
    in_shard: torch.Tensor  # (B, T) bool: the label is one of this shard's real rows
    token_weight: torch.Tensor  # (B, T) d loss / d (per-token cross entropy): 0 for ignored labels


class VocabParallel:
    """The engine's side: the VF/VB passes and the tied-gradient exchange (see the module docstring)."""

    def __init__(self, engine: "PipelineStage") -> None:
        self.engine = engine
        self.head: VocabShardHead = engine.module.vocab_head
        self.group = engine.grid.get_pipe_parallel_group()
        self.last = engine.placement[-1]  # the rank of the last chunk, whose output VF hands over
        self.src = engine.grid.stage_to_global(self.last)
        self.is_last = engine.stage_id == self.last
        self.hidden_size = self.head.weight.shape[1]
        self._handed: dict[tuple[int, int], tuple[Any, Any, torch.Tensor]] = {}  # last stage: (h, labels, placeholder)
        self._units: dict[tuple[int, int], _Unit] = {}
        self.tied_holders: tuple[int, ...] = ()
        self.grads = engine.grad_sink  # the shard's gradients, where (and in the scale) the optimizer reads them
        spec = self.head.spec
        # the split input embedding's passes EF/EB (runtime/features/vocab_embedding.py), else None
        split = self.head.embedding
        self.embedding = None if split is None else VocabEmbedding(
            engine, self.head if split.tied else engine.module.vocab_embed, split)
        if spec.tied_key is not None and self.embedding is None:
            module = engine.module
            self.tied_holders = tuple(sorted({module.stage_owner(i) for i, s in enumerate(module._layer_specs)
                                              if isinstance(s, TiedLayerSpec) and s.key == spec.tied_key}))

    @staticmethod
    def check_engine(engine: "PipelineStage") -> None:
        """Refusals that need the engine (every rank: the same config and model)."""
        wanted, built = engine.terapipe.vocab_parallel, getattr(engine.module, "vocab_head", None) is not None
        if wanted != built:
            raise ValueError(f"terapipe.vocab_parallel={wanted} but the model was built with vocab_parallel={built}; "
                             f"build it as ds_terapipe.TokenPipelineModule(..., vocab_parallel={wanted}) (or "
                             "**ds_terapipe.module_chunk_kwargs(terapipe))")

    def reset(self) -> None:
        self._handed.clear()
        self._units.clear()
        if self.embedding is not None:
            self.embedding.reset()

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around a schedule's instructions (the split embedding serves the units' EF results)."""
        self.reset()
        if self.embedding is None:
            yield
            return
        with self.embedding.live():
            yield

    def placeholder_loss(self) -> Callable[[Any, Any], torch.Tensor]:
        """The loss DeepSpeed's forward computes on the last stage (the engine puts it in place of the module's
        ``loss_fn``): a placeholder VF fills in; the hidden states and labels are kept for VF."""

        def placeholder(outputs: Any, labels: Any) -> torch.Tensor:
            ctx = current_slice()
            assert ctx is not None, "a vocabulary-parallel loss outside a slice"
            value = torch.zeros((), device=self.engine.device)
            self._handed[(ctx.microbatch, ctx.slice_index)] = (outputs, labels, value)
            return value

        return placeholder

    def labels_problem(self, labels: Any) -> Optional[str]:
        """Why a micro-batch's labels cannot be run (rule, value, fix), or None: a label outside the vocabulary that
        is not -100. The split softmax finds a label's logit on the shard whose rows hold it; one that no shard holds
        would be trained against a target logit of 0 where torch's ``cross_entropy`` refuses it
        (``runtime/execution/batch_checks.py``)."""
        problem = out_of_range_ids(labels, self.head.vocab_size, "label", ignore_index=IGNORE_INDEX)
        return None if problem is None else (f"terapipe.vocab_parallel: {problem}; no shard of the output layer "
                                             "holds it: fix the labels, or build the model with the tokenizer's "
                                             "vocabulary size")

    def forward_pass(self, buffer_id: int, microbatch: int, slice_index: int) -> None:
        training = torch.is_grad_enabled()
        with torch.no_grad():  # gradients are computed by hand in backward_pass: no graph to keep
            self._forward(microbatch, slice_index, training)

    def _forward(self, microbatch: int, slice_index: int, training: bool) -> None:
        engine, head = self.engine, self.head
        assert not engine.eval_return_logits, "refused by the engine's eval_batch"
        start, end = engine.token_bounds(slice_index, microbatch)   # this rank's share under sequence parallelism
        shape = (engine.micro_batch_size, end - start)
        what = f"the vocabulary forward of micro-batch {microbatch} slice {slice_index}"
        if self.is_last:
            outputs, labels, placeholder = self._handed.pop((microbatch, slice_index))
            if not torch.is_tensor(outputs) or tuple(outputs.shape) != (*shape, self.hidden_size) or \
                    not torch.is_tensor(labels) or tuple(labels.shape) != shape:
                got = tuple(outputs.shape) if torch.is_tensor(outputs) else type(outputs).__name__
                raise ValueError(f"terapipe.vocab_parallel: the last stage must output hidden states of shape "
                                 f"{(*shape, self.hidden_size)} and read labels {shape}; got {got} and "
                                 f"{tuple(labels.shape) if torch.is_tensor(labels) else type(labels).__name__}")
        # the labels and the hidden states in one broadcast (int64 first: the hidden states' offset stays aligned)
        tokens = math.prod(shape)
        wire = torch.empty(tokens * (8 + head.weight.element_size() * self.hidden_size), dtype=torch.uint8,
                           device=engine.device)
        received = wire[:8 * tokens].view(torch.int64).view(shape)
        hidden = wire[8 * tokens:].view(head.weight.dtype).view(*shape, self.hidden_size)
        if self.is_last:
            received.copy_(labels)
            hidden.copy_(outputs.detach())
        self._wait([dist.broadcast(wire, self.src, group=self.group, async_op=True)], what)
        labels = received
        logits = F.linear(hidden, head.weight, head.bias).float()  # (B, T, R)
        if head.num_valid < head.rows:
            logits[..., head.num_valid:] = float("-inf")
        index = labels - head.offset
        in_shard = (index >= 0) & (index < head.num_valid)
        index = index.clamp(0, head.rows - 1)
        target = torch.where(in_shard, logits.gather(-1, index.unsqueeze(-1)).squeeze(-1), 0.0)
        lse, target = self._log_sum_exp(logits, target, what)
        counted = labels != -100
        # causal_lm_loss (sum / label positions) times the slice's share of the tokens, as _weighted_loss does
        scale = (end - start) / engine.seq_len_of(microbatch) / labels.numel()
        loss = torch.where(counted, lse - target, 0.0).sum() * scale
        if self.is_last:
            placeholder.copy_(loss)  # DeepSpeed's loss list holds it (detached, same storage)
            engine.total_loss += loss
        if training:
            self._units[(microbatch, slice_index)] = _Unit(hidden, logits, lse, index, in_shard,
                                                           counted.float() * scale)

    def _log_sum_exp(self, logits: torch.Tensor, target: torch.Tensor, what: str) -> tuple[torch.Tensor, ...]:
        """The log-sum-exp over the whole vocabulary and the target logit of every token (B, T), from this shard's
        logits (B, T, R) and target (0 where the label is another shard's), in one all-reduce: each rank's row of
        a (shards, 3, B, T) buffer holds its max ``m``, its sum of ``exp(logit - m)`` and its target, the others'
        rows zeros, so the sum is every shard's row (x + 0 is exact); then ``M = max m`` and ``lse = M + log sum
        exp(m - M) * s``. One synchronisation of the pipeline per slice, not two (an all-reduce of the max, then of
        the sums): the second would wait on the first."""
        top = logits.amax(dim=-1).clamp_min(torch.finfo(logits.dtype).min)   # a shard of padding rows only: -inf
        # one row per shard: shard r is the pipeline group's rank r (stage r)
        rows = torch.zeros((self.head.num_shards, 3, *top.shape), dtype=logits.dtype, device=top.device)
        mine = rows[self.head.rank]
        mine[0], mine[2] = top, target
        torch.sum(torch.exp(logits - top.unsqueeze(-1)), dim=-1, out=mine[1])
        self._wait([dist.all_reduce(rows, group=self.group, async_op=True)], what)
        tops, sums, targets = rows.unbind(dim=1)
        best = tops.amax(dim=0)
        return best + torch.log((sums * torch.exp(tops - best)).sum(dim=0)), targets.sum(dim=0)

    def backward_pass(self, buffer_id: int, microbatch: int, slice_index: int) -> None:
        with torch.no_grad():
            grad_hidden = self._backward(microbatch, slice_index)
        if self.is_last:
            outputs = self.engine.pipe_buffers["outputs"][buffer_id]
            # DeepSpeed's backward of the last stage starts from a loss: this one's gradient on h is grad_hidden
            self.engine.unit_losses[buffer_id] = (outputs * grad_hidden).sum()

    def _backward(self, microbatch: int, slice_index: int) -> torch.Tensor:
        engine, head = self.engine, self.head
        unit = self._units.pop((microbatch, slice_index))
        grad = torch.exp(unit.logits - unit.lse.unsqueeze(-1))  # softmax over the whole vocabulary, this shard
        grad.scatter_add_(-1, unit.index.unsqueeze(-1), -unit.in_shard.float().unsqueeze(-1))
        grad *= unit.token_weight.unsqueeze(-1)  # (B, T, R): d loss / d logits
        gas = engine.gradient_accumulation_steps()  # DeepSpeed's backward divides the loss by it
        if head.bias is not None:
            self.grads.add(head.bias, grad.reshape(-1, grad.shape[-1]).sum(dim=0) / gas)
        # Both GEMMs run in bf16 when the head is bf16, as autograd runs them for an unsharded bf16 head (fp32 copies
        # of the weight per slice made the shard's backward 2-3x slower than the layer it replaces). fp16 keeps
        # fp32: the unscaled d loss / d logits (~1 / tokens / vocabulary) would underflow fp16's range.
        low = grad.to(head.weight.dtype) if head.weight.dtype == torch.bfloat16 else grad
        flat = low.reshape(-1, low.shape[-1])
        hidden = unit.hidden.reshape(-1, unit.hidden.shape[-1]).to(low.dtype)
        self.grads.add(head.weight, flat.t().mm(hidden).float() / gas)
        weight = head.weight if low.dtype == head.weight.dtype else head.weight.float()
        grad_hidden = low.matmul(weight).float().contiguous()  # (B, T, H), summed over the shards in fp32
        self._wait([dist.reduce(grad_hidden, self.src, group=self.group, async_op=True)],
                   f"the vocabulary backward of micro-batch {microbatch} slice {slice_index}")
        return grad_hidden.to(unit.hidden.dtype)

    def reduce_tied_grads(self) -> None:
        """Sum the tied embedding's gradient and the shards' into one (V, H) gradient; each copy keeps its rows."""
        if not self.tied_holders:
            return
        engine, head = self.engine, self.head
        padded = head.rows * head.num_shards
        total = torch.zeros((padded, self.hidden_size), dtype=torch.float32, device=engine.device)
        stage = engine.stage_id
        tied = self._held_embedding()
        if tied is not None:
            tied_grad = self.grads.read(tied)
            if stage == self.tied_holders[0] and tied_grad is not None:
                total[:head.vocab_size] += tied_grad
        head_grad = self.grads.read(head.weight)
        if head_grad is not None:
            total[head.offset:head.offset + head.rows] += head_grad
        self._wait([dist.all_reduce(total, group=self.group, async_op=True)], "the tied output-layer gradients")
        if tied is not None:
            self.grads.write(tied, total[:head.vocab_size])
        self.grads.write(head.weight, total[head.offset:head.offset + head.rows])

    def exchanged_parameters(self) -> list[torch.nn.Parameter]:
        """The tensors whose gradients :meth:`reduce_tied_grads` writes on this rank: its copy of the tied embedding
        (where it holds one) and its shard of the output layer; none with an untied head."""
        if not self.tied_holders:
            return []
        tied = self._held_embedding()
        return [self.head.weight] if tied is None else [tied, self.head.weight]

    def _held_embedding(self) -> Optional[torch.nn.Parameter]:
        """This rank's copy of the whole tied embedding the shards exchange gradients with (None: it holds none)."""
        if self.engine.stage_id not in self.tied_holders:
            return None
        spec = self.head.spec
        return get_dotted(self.engine.module.tied_modules[spec.tied_key], spec.weight_name)

    def _wait(self, works: list, what: str) -> None:
        self.engine.p2p.wait_all(works, what, self.group)
