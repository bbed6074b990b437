"""GradReduction: a training step's gradients and loss, from the end of its schedule to the optimizer step.

What it owns: the instructions after the schedule (``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep``) as
the TokenPipelineEngine runs them: the step's deferred weight gradients handed to ``.grad`` once, before anything
reads them; the sums over a stage's sequence ranks, over data-parallel replicas (DeepSpeed's, skipped where it is
an exact identity) and over tied weights (with the vocabulary shards' exchange; ordered around the data-parallel
average so that the copies stay equal); clipping by the whole model's norm; the fp16 scale moved once the step has
used it. Also the Linears' gradient accumulation inside their GEMMs (on unless something hooks every
accumulation), and the step's loss: summed over the sequence ranks, then DeepSpeed's aggregation under the
engine's deadlines and abort flag.

Why apart from the engine's core: the core runs slices; this runs once per step over whole gradients, extending
DeepSpeed's own handlers (each ``super()`` reaches ``PipelineEngine``'s), and the rules that keep it exact (when
DeepSpeed's reduction is an identity, where each optimizer keeps its gradients, when the scale moves) are read
together here.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..features.vocab_shard import get_dotted
from ..slicing.deferred import enable_fused_grad_accumulation, fused_parameters
from .clip import clip_by_global_norm
from .loss_scale import reports_scaled_norm, scale_moved_after_step

__all__ = ["GradReduction"]

# the engine's logger: these records are the engine's, under the name its users filter on
logger = logging.getLogger(f"{__package__}.engine")


class GradReduction:
    """A step's gradients and loss from the end of its schedule to the optimizer step: a mixin of
    ``TokenPipelineEngine`` (see the module docstring)."""

    # -- the instructions after the schedule -----------------------------------------------------------------
    def _hand_over_weight_grads(self) -> None:
        """The step's deferred weight gradients into ``.grad``: once, before anything reads or reduces gradients
        (tied-weight and data-parallel reductions, clipping, the optimizer, the freezer's statistics)."""
        left = {key: sorted(stash.slices()) for key, stash in self._stashes.items() if len(stash)}
        if left:   # a schedule without a W for a recorded backward: those weight gradients would be lost
            raise RuntimeError(f"token pipeline: schedule {self.running.schedule.name!r} left deferred weight "
                               f"gradients uncomputed at the end of the step ((chunk, micro-batch): slices {left}); "
                               "every backward needs a W of its slice (or one W per micro-batch at slice 0): "
                               "a schedule bug, please report it; set terapipe.deferred_weight_grads to false "
                               "to train without deferral meanwhile")
        if not len(self._weight_grads):
            return
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()
        self._weight_grads.hand_over()
        if self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    def _exec_reduce_tied_grads(self) -> None:
        self._hand_over_weight_grads()
        if self.sharded is not None:
            self.sharded.reduce_tied_grads()
            return
        if getattr(self, "freezer", None) is not None:   # a zero gradient where only frozen layers use the weight
            self.freezer.fill_tied_grads(self)
        if self.using_bf16_optimizer:   # a tied weight frozen before BF16_Optimizer was built has no master gradient
            for weight, _ in self.module.get_tied_weights_and_groups():
                if not weight.requires_grad and not hasattr(weight, "_hp_grad"):
                    weight._hp_grad = None   # DeepSpeed's reduction skips it, as on every rank that holds it
        if self._tied_order == "before":
            self._sum_tied_grads()

    def _sum_tied_grads(self) -> None:
        """DeepSpeed's sum of each tied weight's gradient over the ranks that hold a copy (with the vocabulary
        shards' exchange)."""
        super()._exec_reduce_tied_grads()
        if self._vocab is not None:
            self._vocab.reduce_tied_grads()

    def _exec_reduce_grads(self) -> None:
        self._hand_over_weight_grads()
        if self.sharded is not None:   # the shards' gradients were reduce-scattered by the schedule's RS actions
            self.sharded.finish_step()
            return
        self._reduce_sequence_grads()
        if self._tied_order == "first replica":
            self._sum_tied_grads_on_the_first_replica()
        if not self._dp_reduce_is_identity():
            super()._exec_reduce_grads()
        if self._tied_order == "after":
            self._sum_tied_grads()

    def _copied_tied_keys(self) -> list[tuple[str, dict]]:
        """DeepSpeed's tied keys (with their entries of ``tied_comms``) that this rank holds and another rank too, by
        key (DeepSpeed lists a key that one rank holds alone as well: it has no copy)."""
        return [(key, comm) for key, comm in sorted(self.module.tied_comms.items()) if len(comm["ranks"]) > 1]

    def _tied_copies(self) -> list[torch.nn.Parameter]:
        """The trainable tensors whose gradient the tied sum writes on more than one rank of a replica: DeepSpeed's
        tied weights held by more than one rank, and with vocabulary parallelism and a tied head, the embedding
        and the output layer's shard (the exchange writes the embedding's rows into the shards)."""
        copies = [get_dotted(comm["module"], name) for _, comm in self._copied_tied_keys()
                  for name in comm["weight_attr"]]
        if self._vocab is not None:
            copies += [p for p in self._vocab.exchanged_parameters() if all(p is not c for c in copies)]
        return [p for p in copies if p.requires_grad]

    def _sum_tied_grads_on_the_first_replica(self) -> None:
        """ZeRO 1's own optimizer with 3 or more replicas: each copy of a tied weight summed over the replicas onto
        the first one (one fp32 reduce per stage), the tied sum there alone (one collective's result in every
        copy), zeros in the other replicas. DeepSpeed's average then adds the sum to zeros, which is exact, so
        the copies stay equal bit for bit whatever order each stage's buckets add the replicas in
        (:meth:`_tied_order_by_config` says why they would not otherwise). Collective over the stage's
        data-parallel group, then over the first replica's tied groups."""
        grads = [self.grad_sink.buffer(p) for p in self._tied_copies()]
        group = self.grid.get_data_parallel_group()
        self.sum_gradients_over(grads, group, "the tied weights' sum over the replicas",
                                onto=dist.get_global_rank(group, 0))
        if self.grid.data_parallel_id != 0:
            for grad in grads:
                grad.zero_()
            return
        self._sum_tied_grads()

    def _tied_order_by_config(self) -> str:
        """Where the tied weights' sum runs, decided once at init: ``"after"`` the data-parallel reduction (in
        ``ReduceGrads``), on ``"first replica"`` only, before it, or ``"before"`` it on every replica (DeepSpeed's
        order, in ``ReduceTiedGrads``).

        Why: the copies of a tied weight must stay equal bit for bit. In DeepSpeed's order each stage averages
        its copy's (already summed, equal) gradient over its replicas inside its own buckets, where the weight
        lies at a different offset, so the all-reduce may add the replicas in another order on each stage: with 3
        or more replicas the copies drift apart by rounding (measured: 1.8e-4 relative after 3 bf16 steps at 2
        stages x 4 replicas; 2 replicas add in one order, a + b = b + a).

        - ``"after"``: where the data-parallel reduction leaves every replica the whole gradient (ZeRO 0,
          DeepSpeed's bf16 optimizer at ZeRO 0 and 1), the copies are summed after the average and get one
          all-reduce's result, the same on every rank of the tied group; the sum is linear, so the gradient is
          the same up to rounding. No extra communication.
        - ``"first replica"``: ZeRO 1's own optimizer (fp32, bf16 accumulating in bf16) keeps only its partition
          of the average, at offsets that differ per stage, so nothing can run after it. With tied copies and 3 or
          more replicas, each stage sums its copies over the replicas onto the first one (one fp32 reduce, the
          size of the copies), the first replica alone runs the tied sum, and the others hand DeepSpeed zeros:
          its average adds one sum to zeros, which is exact (:meth:`_sum_tied_grads_on_the_first_replica`).
        - ``"before"``: shard_params (its reduce-scatter ran in the schedule), 2 replicas or fewer, and fp16 at
          ZeRO 1, whose scaled gradients could overflow in the first replica's undivided sum where DeepSpeed's
          average would not; with tied copies and 3 or more replicas fp16 warns of the drift."""
        if self.terapipe.shard_params:   # the reduce-scatter ran in the schedule already: dp, then tied
            return "before"
        if self.using_bf16_optimizer or self.zero_optimization_stage() == 0:
            return "after"
        replicas = self.grid.data_parallel_size
        # by structure, not by requires_grad: every rank of a tied group (and of the vocabulary exchange's
        # pipeline group) must take the same order, or the first replica's tied sum would wait for the others
        names = self._tied_names()
        if replicas <= 2 or not names:
            return "before"
        if not self.fp16_enabled():
            logger.info("terapipe: stage %d sums the gradients of its tied copies (%s) over the %d replicas onto the "
                        "first replica before ZeRO %d's average (one fp32 reduce of %d elements per step), so that the "
                        "copies stay equal bit for bit", self.stage_id, ", ".join(names), replicas,
                        self.zero_optimization_stage(), sum(p.numel() for p in self._tied_copies()))
            return "first replica"
        logger.warning("terapipe: stage %d holds a copy of a tied weight (%s), also held by another stage; with fp16, "
                       "ZeRO %d's optimizer (%s) averages each copy over the %d replicas in its own buckets, which may "
                       "add them in another order on each stage, so the copies drift apart by rounding (measured in "
                       "that order after 3 steps at 4 replicas: 2e-4 relative in bf16). To keep them equal bit for "
                       "bit, use bf16, fp32 or ZeRO 0: there the engine orders the sums so that every copy gets one "
                       "collective's result", self.stage_id, ", ".join(names),
                       self.zero_optimization_stage(), type(self.optimizer).__name__, replicas)
        return "before"

    def _tied_names(self) -> list[str]:
        """What this rank holds copies of, by structure (trainable or not), for the order's decision and its
        messages: DeepSpeed's tied keys held by more than one rank, and the output layer's vocabulary shard where
        the exchange writes a whole embedding's rows into it."""
        names = [repr(key) for key, _ in self._copied_tied_keys()]
        if self._vocab is not None and self._vocab.tied_holders:
            names.append("the output layer's vocabulary shard")
        return names

    def _exec_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        self._hand_over_weight_grads()
        if getattr(self, "freezer", None) is not None:
            self.freezer.observe_gradients(self)
        super()._exec_optimizer_step(*args, **kwargs)
        if getattr(self, "freezer", None) is not None:   # the auto policy's check, unless DeepSpeed skipped the step
            self.freezer.after_optimizer_step(self)

    def _take_model_step(self, *args: Any, **kwargs: Any) -> None:
        """DeepSpeed's step, with the fp16 scale moved once the step has divided the gradients by it and before
        DeepSpeed's ``_exec_optimizer_step`` logs it (the monitor's ``loss_scale`` is the next step's, as in
        DeepSpeed)."""
        scale = self._loss_scale_deepspeed_leaves_out()   # the scale of this step's backward (fp16 without ZeRO)
        with scale_moved_after_step(self.optimizer):   # fp16: divided by the scale of the backward
            super()._take_model_step(*args, **kwargs)
        if scale is not None and self._global_grad_norm is not None and reports_scaled_norm(self.optimizer):
            self._global_grad_norm = self._global_grad_norm / scale   # get_global_grad_norm(): unscaled

    def clip_fp32_gradients(self) -> None:
        """DeepSpeed's fp32 clipping without ZeRO (its ``_take_model_step`` calls this), by the norm of the whole
        model's gradient, summed over the pipeline (``runtime/execution/clip.py``); DeepSpeed's own counts stage 0's
        gradients alone. The norm is what ``get_global_grad_norm()`` reports for the step."""
        self._global_grad_norm = clip_by_global_norm(self)

    # -- gradient sums and when DeepSpeed's is an identity ---------------------------------------------------
    def _reduce_sequence_grads(self) -> None:
        """Sum the weight gradients over the stage's sequence ranks: each computed its tokens' share of them
        (replicated parameters, as DeepSpeed's Ulysses sums them); before clipping and the data-parallel mean."""
        if self.sequence is None:
            return
        # where each optimizer keeps them (bf16: its fp32 master gradients; fp16: .grad, loss-scaled, which a sum
        # keeps), zeros where a parameter has none yet, so every sequence rank sends the same layout
        grads = [self.grad_sink.buffer(p) for p in self.module.parameters() if p.requires_grad]
        self.sum_gradients_over(grads, self.sequence.group, "the sequence-parallel gradient sum")

    def sum_gradients_over(self, grads: list[torch.Tensor], group: Any, what: str, divide: int = 1,
                           onto: int | None = None) -> None:
        """Sum ``grads`` in place over ``group`` (then divide by ``divide``) as one fp32 buffer, one all-reduce
        waited with the p2p deadline and abort flag (``what`` names it in a failure); with ``onto`` (a global
        rank) one reduce instead, the sum written on that rank alone. Collective: every rank of the group passes
        the same layout."""
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        if onto is None:
            self.p2p.wait(dist.all_reduce(flat, group=group, async_op=True), what, group)
        else:
            self.p2p.wait(dist.reduce(flat, onto, group=group, async_op=True), what, group)
            if dist.get_rank() != onto:
                return
        if divide != 1:
            flat.div_(divide)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def _dp_reduce_is_identity(self) -> bool:
        """Whether DeepSpeed's data-parallel reduction would leave every gradient as it is (skipped then).

        Why: with one replica DeepSpeed's fallback still flattens the stage's gradients into a fresh buffer,
        scales it by 1, all-reduces it over a group of one and copies it back: 50-65 ms per step for a 4 x 512
        stage on one CPU core (about 3% of a 2-stage m = 1 step), which the step model (a zero data-parallel
        term for one replica) does not contain. It is an exact identity only on that path: fp32/fp16 without
        ZeRO or the bf16 optimizer (they reduce through their own buffers), dense gradients in the
        communication dtype (another dtype would round them on the way), no MoE expert groups, and no
        pre-divide factor (scaling by f then by 1/f can round).
        """
        if not self._dp_identity_by_config:
            return False
        wire = self.communication_data_type
        return all(p.grad is None or (p.grad.dtype == wire and not p.grad.is_sparse)
                   for p in self.module.parameters() if p.requires_grad)

    def dp_reduce_will_be_identity(self) -> bool:
        """:meth:`_dp_reduce_is_identity` before any gradient exists (the step cost model asks at init,
        ``runtime/planning/step_profile.py``): the gradients will have their parameters' dtype."""
        wire = self.communication_data_type
        return self._dp_identity_by_config and all(p.dtype == wire for p in self.module.parameters()
                                                   if p.requires_grad)

    def _dp_reduce_identity_by_config(self) -> bool:
        """The configuration's part of :meth:`_dp_reduce_is_identity`, decided once at init (it cannot change
        while the engine lives: a repack builds a new engine)."""
        if self.grid.data_parallel_size != 1 or self.zero_optimization_stage() != 0 or self.using_bf16_optimizer:
            return False
        if self.has_moe_layers or not self.pipeline_enable_backward_allreduce:
            return False
        return not (self.gradient_average and self.postscale_gradients() and self.gradient_predivide_factor() != 1.0)

    # -- gradient accumulation inside the Linears' GEMMs -----------------------------------------------------
    def _fuse_grad_accumulation(self) -> bool:
        """Whether the stage's ``nn.Linear`` weight (and, on an accelerator, fp32 bias) gradients are added into
        ``.grad`` inside their GEMM during training (``terapipe.fuse_grad_accumulation``;
        ``runtime/slicing/deferred.py``): on unless the config turns it off or something must see every
        accumulation through autograd: DeepSpeed's ZeRO and bf16 optimizers when they hook it (their
        ``_grad_acc_hooks``: ZeRO with contiguous gradients or overlapped reduction, bf16 with
        ``immediate_grad_update``), and FSDP2 under ``shard_params``, which owns the gradients."""
        why = None
        if not self.terapipe.fuse_grad_accumulation:
            why = "terapipe.fuse_grad_accumulation is false"
        elif self.terapipe.shard_params:
            why = "shard_params reduce-scatters the gradients through FSDP2"
        elif getattr(self.optimizer, "_grad_acc_hooks", None):
            why = f"{type(self.optimizer).__name__} hooks every accumulation into .grad"
        if why is not None:
            logger.info("terapipe: stage %d accumulates the Linears' gradients through autograd (%s)", self.stage_id,
                        why)
            return False
        count = enable_fused_grad_accumulation(self.module)
        logger.info("terapipe: stage %d adds the gradients of %d nn.Linear module(s) into .grad inside their GEMMs "
                    "(%d tensors)", self.stage_id, count, len(fused_parameters(self.module)))
        return True

    def fused_parameters(self) -> list[torch.nn.Parameter]:
        """The Linears' weights and biases whose gradients training adds into ``.grad`` inside their GEMMs (none when
        it does not, nor once ``engine.compile()`` ran: inside a compiled graph autograd accumulates them)."""
        if not self.fused_grad_accumulation or getattr(self, "is_compiled", False):
            return []
        return fused_parameters(self.module)

    # -- the step's loss -------------------------------------------------------------------------------------
    def _aggregate_total_loss(self) -> Any:
        if self.sequence is not None and self.is_last_stage() and self.total_loss is not None:
            # each sequence rank's loss is its tokens' share of the micro-batches' losses
            self.p2p.wait(dist.all_reduce(self.total_loss, group=self.sequence.group, async_op=True),
                          "the sequence-parallel loss sum", self.sequence.group)
        with self._deepspeed_collectives_watched("the step's loss (its data-parallel mean and broadcast)"):
            return super()._aggregate_total_loss()

    @contextmanager
    def _deepspeed_collectives_watched(self, what: str) -> Iterator[None]:
        """Inside the block, DeepSpeed's blocking ``broadcast`` and ``all_reduce`` (``deepspeed.comm``) are issued
        asynchronously and waited for as every wait of the engine is: at most ``p2p_timeout_s``, and stopped by a
        peer's abort flag. Why: DeepSpeed's loss aggregation after every step waits for the last stage's broadcast
        with no deadline, so a peer that hangs (not one that dies: its closed connection ends the wait) would hold
        every other rank there for good."""
        import deepspeed.comm as ds_comm

        originals = {name: getattr(ds_comm, name) for name in ("broadcast", "all_reduce")}

        def watched(name: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                if kwargs.get("async_op"):
                    return originals[name](*args, **kwargs)
                self.p2p.wait(originals[name](*args, **dict(kwargs, async_op=True)), f"{what}: {name}",
                              kwargs.get("group"))
                return None
            return call

        for name in originals:
            setattr(ds_comm, name, watched(name))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(ds_comm, name, original)

    def _reduce_outputs(self, outputs: Any, *args: Any, **kwargs: Any) -> Any:
        reduced = super()._reduce_outputs(outputs, *args, **kwargs)
        if self.sequence is None:
            return reduced
        # eval: the shares' losses summed (the average, or each micro-batch's loss with reduce_output=None)
        losses = [reduced] if torch.is_tensor(reduced) else list(reduced)
        summed = []
        for loss in losses:
            loss = loss.clone()
            self.p2p.wait(dist.all_reduce(loss, group=self.sequence.group, async_op=True),
                          "the sequence-parallel evaluation loss sum", self.sequence.group)
            summed.append(loss)
        return summed[0] if torch.is_tensor(reduced) else summed
