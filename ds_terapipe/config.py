"""The ``"terapipe"`` section of the DeepSpeed JSON config.

Example::

    "terapipe": {"enabled": true, "seq_len": 1024, "slices": "auto", "schedule": "1f1b",
                 "plan_cache": "runs/plans"}

Validated once, with DeepSpeed's own config base class, so it reads like any other DeepSpeed section: unknown
keys are refused by pydantic (the base's ``extra="forbid"``; a typo must not silently fall back to a default)
and ranges are field constraints. Values are read in pydantic's lax mode, as DeepSpeed reads its own sections (a
string ``"64"`` for an int is taken as 64). :func:`parse_terapipe_config` turns pydantic's report into one line
naming the key and the value, with the rule where the key has one (a range, a schedule name) and otherwise
pydantic's reason and "set a valid value or drop the key for the default", and lists the valid keys for an
unknown one. Allowed ``schedule`` values and the default for ``deferred_weight_grads`` come from the schedule
registry (``planner/registry.py``).

A field's ``description`` is what the key means to a user, the text of its row in ``docs/configuration.md`` (that
table is generated from these models: :mod:`ds_terapipe.config_doc`); an attribute docstring adds what a reader of
the code needs on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Literal, Optional, Union

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from .planner.registry import get_schedule, schedule_names

__all__ = ["AutoFreezeConfig", "FreezeConfig", "ProfileConfig", "ReplanConfig", "TeraPipeConfig",
           "parse_terapipe_config", "TERAPIPE_KEY"]

TERAPIPE_KEY = "terapipe"


class ProfileConfig(DeepSpeedConfigModel):
    """How each stage measures its own layers when ``slices`` is ``"auto"``."""

    model_config = ConfigDict(extra="forbid")

    slice_lengths: Optional[List[int]] = Field(None, description=(
        "slice lengths timed at context 0, each a multiple of `granularity` and at most `seq_len`; the plan has no "
        "slice shorter than the shortest of them"),
        json_schema_extra={"doc_default": "`granularity` x powers of 2, and `seq_len` (at most 6)"})
    """Slice lengths (tokens) to time at context 0; default: ``granularity`` times powers of two below ``seq_len``,
    and ``seq_len`` (at most 6 of them), which brackets every slice the planner may pick. Given, the planner picks no
    slice shorter than the shortest (the fit knows nothing below it)."""

    num_contexts: int = Field(3, ge=1, description=(
        "prefix lengths timed per slice length (for the context term of the cost model)"))
    """How many prefix lengths (spread over ``[0, seq_len)``) to time per slice length, for the context term."""

    warmup: int = Field(1, ge=0, description="untimed rounds over the profiling grid, before the timed ones")
    """Untimed rounds over the grid before the timed ones (first calls allocate)."""

    repeats: int = Field(3, ge=1, description=(
        "timed rounds over the profiling grid (each point keeps its median; rounds, not back-to-back repeats, so a "
        "burst of load on a shared host spoils one sample of many points rather than every sample of a few)"))
    """Timed rounds over the grid; each point keeps its median. Three, so the median rejects one disturbed sample
    (the median of two is their mean)."""

    recheck_cached: bool = Field(True, description=(
        "on a plan-cache hit every stage times the plan's median slice length again (about a second); when the "
        "device runs more than 5% off the cached costs (a shared host under other load, another machine of the same "
        "type) they are rescaled to this run's speed and the slicing solved again, logged either way, so the plan "
        "and its predicted step are this run's (measured through the trainer on a shared host, re-timed cache hits "
        "predicted the step within -4.6% to +4.0% in one run, -13.7% to +2.5% in a noisier one)"))
    """On a plan-cache hit, time the plan's median slice length again (about a second per stage) and, when the
    device runs more than 5% faster or slower in this run than the cached costs (a shared host under other load, another
    host of the same type), rescale them and solve again: the plan and its predicted step match this run's
    speed. Not part of the cache key."""


class ReplanConfig(DeepSpeedConfigModel):
    """Online re-planning (``runtime/planning/replan.py``): after warm-up, refit the cost model to measured action times
    and switch to a better slicing when it pays; all ranks switch at the same step, results do not change."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description=(
        'online re-planning (needs `slices: "auto"`): after `replan.warmup_steps` steps the engine records '
        "`replan.measure_steps` steps' timelines, rank 0 scales each chunk's profiled costs by measured / predicted "
        "(forward, backward and W apart), replaces the whole-step terms (optimizer step, tied and data-parallel "
        "reduction, the step outside the instruction loop) by what those steps measured, fits a fixed time per "
        "forward and backward action for what the engine does between actions (so the refit schedule takes what the "
        "measured one took), re-solves, and every rank switches at the same step when the refit model predicts at "
        "least `replan.min_gain` less step time; logged either way; a kept plan's prediction "
        "(`engine.predicted_step_ms`, which the example trainer prints) becomes the refit model's, and the log puts "
        "it beside the measured step (schedule and what follows it apart). Slicing is exact, so a switch never "
        "changes results (tested across a switch); afterwards it records nothing (one comparison per step)"))
    """Re-plan once from measurements (needs ``slices: "auto"``: a plan from the config is the user's)."""

    warmup_steps: int = Field(5, ge=0, description=(
        "training steps before measuring (the first steps allocate and warm caches, and run slower than the later "
        "ones)"))
    """Training steps before measuring: the first steps allocate and warm caches (measured with the example
    trainer: its first 4-5 steps run 5-40% slower than the later ones, and a refit from them overestimates)."""

    measure_steps: int = Field(3, ge=1, description=(
        "training steps measured for the refit (each step's measured / predicted per chunk and kind, the median "
        "over the steps kept: three outvote one step a stall of the host fell into)"))

    min_gain: float = Field(0.03, ge=0.0, allow_inf_nan=False, description=(
        "switch only when the refit model predicts at least this fraction less step time (0.03: 3%; 1 or more: "
        "never switch, only refit the prediction)"))
    """Switch only when the refit model predicts the new slicing at least this much faster (0.03: 3%)."""


class AutoFreezeConfig(DeepSpeedConfigModel):
    """The automatic freezing policy (``runtime/features/freeze.py``, as in PipeTransformer): every ``check_interval``
    optimizer steps taken each still-training layer's gradient norm is measured (after the data-parallel reduction,
    before the optimizer step, unscaled; a step DeepSpeed skips is no check). A layer is *stable* when its norm
    changed by at most ``tolerance`` (relative) since the previous check. The stable layers in a row right behind
    the frozen prefix freeze, at most ``max(1, floor(aggressiveness x training layers))`` of them per check; a layer
    that is not stable stops the run (front to back only), and nothing ever unfreezes. Layers count DeepSpeed's
    layer list (global indices, as in checkpoint files), those without parameters ride along with the layer in front
    of them."""

    model_config = ConfigDict(extra="forbid")

    check_interval: int = Field(10, ge=1, description=(
        "optimizer steps taken between two gradient-norm checks (the first check only records; a step DeepSpeed "
        "skips is not counted and is no check)"))

    warmup_steps: int = Field(0, ge=0, description=(
        "no check before this many steps (gradients of the first steps move a lot)"))

    tolerance: float = Field(0.1, gt=0.0, description=(
        "a layer is stable when `abs(norm - previous norm) / previous norm <= tolerance` between two checks"))

    aggressiveness: float = Field(0.5, gt=0.0, le=1.0, description=(
        "the fraction of the still-training layers (with parameters) one check may freeze, at least one; 1.0 "
        "freezes every stable layer in a row at once"))
    """The fraction of the still-training layers (with parameters) one check may freeze (at least one):
    PipeTransformer's alpha. 1.0 freezes every stable layer in a row at once."""

    max_frozen_layers: Optional[int] = Field(None, ge=1, description=(
        "never freeze beyond this many layers (none: all but the last layer with parameters)"))


class FreezeConfig(DeepSpeedConfigModel):
    """Progressive freezing of the front layers (``runtime/features/freeze.py``): frozen layers run forward only,
    take no backward and no weight gradient, their optimizer state is released; ranks whose layers are all frozen
    get no gradient. Exactly one policy: ``schedule`` or ``auto``."""

    model_config = ConfigDict(extra="forbid")

    schedule: Optional[List[List[int]]] = Field(None, description=(
        "`[[step, num_frozen_layers], ...]`: from training step `step` on (optimizer steps taken: a step DeepSpeed "
        "skips is not counted), the first `num_frozen_layers` layers (DeepSpeed's layer list: embedding = 0, blocks, "
        "..., head) are frozen; steps strictly increasing, counts never decreasing. See [Progressive "
        "freezing](freezing.md)"))
    """``[[step, num_frozen_layers], ...]``: from training step ``step`` (optimizer steps taken before the batch:
    DeepSpeed's ``global_steps`` less its ``skipped_steps``) on, the first ``num_frozen_layers`` layers of the model
    (DeepSpeed's layer list, global indices) are frozen. Steps strictly increase and counts never decrease (a layer
    never unfreezes)."""

    auto: Optional[AutoFreezeConfig] = Field(None, description=(
        "the gradient-norm policy instead of a schedule (its keys below); rule under [Progressive "
        "freezing](freezing.md)"))
    """The automatic policy from per-layer gradient-norm change (see :class:`AutoFreezeConfig`)."""

    replan: bool = Field(True, description=(
        'after each freeze, re-plan the slicing (with `slices: "auto"`) from the costs profiled at init with the '
        "frozen backward removed"))
    """After each freeze, re-plan the slicing from the costs profiled at init with the frozen layers' backward
    removed (``slices: "auto"`` only; a plan from the config is the user's and stays)."""

    repack: bool = Field(False, description=(
        "once whole stages hold frozen layers only, continue on fewer stages with more data-parallel replicas (same "
        "processes); see [Repacking](freezing.md#repacking-freeze--repack-true)"))
    """After a freeze that leaves whole pipeline stages with frozen layers only, continue on fewer stages with more
    data-parallel replicas, in the same processes (PipeTransformer's elastic pipelining; ``runtime/features/repack.py``
    states the rule). Needs ``gradient_accumulation_steps`` divisible by the number of pipeline stages, one chunk
    per rank, a ``TokenPipelineModule`` and data handed to ``train_batch`` on every rank."""

    @field_validator("schedule", mode="before")
    @classmethod
    def _check_schedule(cls, value: Any) -> Any:
        if value is None:
            return value
        pairs = isinstance(value, list) and all(
            isinstance(e, (list, tuple)) and len(e) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                 for x in e) for e in value)
        if not pairs or not value:
            raise ValueError(f"terapipe.freeze.schedule={value!r}: use a non-empty list of [step, num_frozen_layers] "
                             "pairs of ints, e.g. [[100, 2], [300, 4]]")
        value = [list(e) for e in value]
        for step, count in value:
            if step < 0 or count < 0:
                raise ValueError(f"terapipe.freeze.schedule={value}: steps and layer counts must be >= 0; got "
                                 f"[{step}, {count}]")
        for (s0, n0), (s1, n1) in zip(value, value[1:]):
            if s1 <= s0 or n1 < n0:
                raise ValueError(f"terapipe.freeze.schedule={value} is not monotone: [{s0}, {n0}] then [{s1}, {n1}]; "
                                 "steps must strictly increase and frozen layer counts never decrease (a frozen "
                                 "layer never unfreezes): sort the entries by step and make the counts grow")
        return value

    @model_validator(mode="after")
    def _one_policy(self) -> "FreezeConfig":
        if (self.schedule is None) == (self.auto is None):
            raise ValueError("terapipe.freeze needs exactly one policy: \"schedule\": [[step, num_frozen_layers], "
                             "...] or \"auto\": {...}" + (", not both" if self.schedule is not None else ""))
        return self


@dataclass(frozen=True)
class SlicingPolicy:
    """``terapipe.slices`` decoded once, so no consumer reads the ``"auto"`` | int | list union itself.

    ``kind``: ``"auto"`` (profile and plan), ``"equal"`` (``count`` equal slices of any length, multiples of
    ``granularity``) or ``"fixed"`` (``lengths``, for their sum only).
    """

    kind: Literal["auto", "equal", "fixed"]
    granularity: int
    count: Optional[int] = None
    lengths: Optional[tuple[int, ...]] = None

    @property
    def is_auto(self) -> bool:
        return self.kind == "auto"

    def fixed_for(self, seq_len: int) -> Optional[tuple[int, ...]]:
        """The slices the config sets for sequences of ``seq_len`` tokens, or None when they are to be planned
        (``"auto"``). ValueError for a length a fixed list or the granularity cannot serve."""
        if self.kind == "auto":
            return None
        if self.kind == "fixed":
            assert self.lengths is not None
            if sum(self.lengths) != seq_len:
                raise ValueError(f"terapipe.slices={list(self.lengths)} is a fixed list for seq_len "
                                 f"{sum(self.lengths)}, but a batch has sequence length {seq_len}; use slices \"auto\" "
                                 "or an int for variable lengths")
            return self.lengths
        assert self.count is not None
        if seq_len % self.granularity:
            raise ValueError(f"terapipe: a batch has sequence length {seq_len}, not a multiple of "
                             f"terapipe.granularity={self.granularity}; pad sequences to a multiple of "
                             f"{self.granularity} (or lower granularity)")
        units = seq_len // self.granularity
        n = min(self.count, units)
        return tuple((units // n + (1 if i < units % n else 0)) * self.granularity for i in range(n))


class TeraPipeConfig(DeepSpeedConfigModel):
    """Token-level pipeline settings (the ``"terapipe"`` section of the DeepSpeed config)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="turn token-level pipelining on")
    """Turn token-level pipelining on. Off: ``ds_terapipe.initialize`` is exactly ``deepspeed.initialize``."""

    seq_len: Optional[int] = Field(None, ge=1, description=(
        "tokens per sequence the plan is made for (*implied by a list of `slices`)"),
        json_schema_extra={"doc_default": "required*"})
    """Tokens per sequence the plan is made for. Required unless ``slices`` is a list (then its sum)."""

    slices: Union[Literal["auto"], int, List[int]] = Field("auto", description=(
        '`"auto"`: profile each stage at init and let the planner choose; an int *n*: *n* equal slices (multiples '
        "of `granularity`); a list: exact token counts summing to `seq_len`, taken as given (any positive lengths: "
        "`granularity` does not apply to them; tested with `[5, 27, 16]`)"))
    """``"auto"``: profile each stage at engine init and let the planner choose; an int n: n equal slices
    (multiples of ``granularity``, the remainder spread over the first slices); a list: exact token counts,
    taken as given (any positive lengths summing to ``seq_len``; ``granularity`` does not apply to them)."""

    granularity: int = Field(8, ge=1, description=(
        'slices the engine chooses (`"auto"`, an int) are multiples of this, and with those it must divide '
        '`seq_len` and every batch length; `"auto"` plans a length of more than 2048 units on a coarser grid (a '
        "multiple of this dividing the length; the planner's search grows faster than the square of its units); "
        "a list of `slices` is run as written"))
    """Slices the engine chooses (``"auto"``, an int) are multiples of this many tokens (keeps kernels efficient
    and the planner fast); it must then divide ``seq_len`` and every batch length. Not applied to a list of
    ``slices``, which is run exactly as written."""

    schedule: str = Field("gpipe", description=(
        '`"gpipe"`: all forwards then all backwards (TeraPipe); `"1f1b"`: token-level 1F1B (Seq1F1B), bounded '
        "activations in flight: with p stages and n slices, stage s (from 0) holds at most n + p - 1 - s slices, "
        "the last stage one micro-batch at a time, as stock 1F1B; the virtual-stage schedules "
        "`interleaved-1f1b`, `looped-bfs`, `dualpipev` and `zbv`: [Schedules](schedules.md)"))
    """A registered schedule (``ds-terapipe schedules`` lists them). ``gpipe``: all forwards, then all backwards
    (TeraPipe). ``1f1b``: token-level 1F1B, bounded memory."""

    virtual_stages: Optional[int] = Field(None, ge=1, description=(
        "chunks per pipeline rank for `interleaved-1f1b`, `looped-bfs` (v >= 2), `dualpipev` and `zbv` (v = 2); build "
        "the module with `**ds_terapipe.module_chunk_kwargs(terapipe)` ([Schedules](schedules.md)); `gpipe` and "
        "`1f1b` take 1"), json_schema_extra={"doc_default": "the schedule's: 1, or 2 for the last four"})
    """Chunks per pipeline rank: the model is cut into ``pipeline stages x virtual_stages`` chunks, placed by the
    schedule (``interleaved-1f1b``, ``looped-bfs``: chunk c on rank c mod p; ``dualpipev``, ``zbv``: chunks r and
    2p-1-r).
    Build the model with the same value: ``TokenPipelineModule(..., virtual_stages=v, schedule=name)``. Default
    (None): the schedule's own, 1 for ``gpipe`` and ``1f1b``, 2 for the others."""

    deferred_weight_grads: Optional[bool] = Field(None, description=(
        "a slice's backward computes input gradients only and sends them on; the `nn.Linear` weight gradients "
        "follow in a `W` action: with `gpipe` once per micro-batch after its last backward, one GEMM per Linear "
        "over all its slices (its Linear inputs and output gradients wait until then: 158 MiB per stage at m = 1 "
        "against 130 without, docs/performance.md); with `dualpipev` and `zbv` one W per slice, placed by the "
        "schedule; with `1f1b` (when set to `true`) after each slice's send (one slice's pairs wait: +11-28% "
        "activations measured, hence off by default there, as with `interleaved-1f1b` and `looped-bfs`); "
        "`shard_params` refuses it. The W passes of a step are summed in place and reach `.grad` once, before the "
        "gradient reductions (bf16/fp16 weights: after each W). "
        "Measured at m = 1 with gpipe: 1.58x stock deferred, 1.54x not deferred (docs/performance.md)"),
        json_schema_extra={"doc_default": "the schedule's: on with `gpipe`, `dualpipev`, `zbv`; off with `1f1b`, "
                                           "`interleaved-1f1b`, `looped-bfs` and with `shard_params`"})
    """Backward of a slice computes input gradients only and sends them on; the ``nn.Linear`` weight gradients
    follow in a ``W`` action (runtime/slicing/deferred.py), so the previous stage gets its gradients sooner. With
    ``gpipe`` one W per micro-batch after its last backward (its Linear inputs and output gradients wait until
    then); with ``1f1b`` one W per slice right after the send (one slice's pairs wait). Default (None): the
    schedule's registered ``ScheduleSpec.deferred_weight_grads``: on with ``gpipe``, ``dualpipev`` and ``zbv``; off
    with ``1f1b`` (whose point is bounded memory: per-slice W measured +11-28% activations), ``interleaved-1f1b`` and
    ``looped-bfs``; off with ``shard_params``."""

    fuse_grad_accumulation: bool = Field(True, description=(
        "a backward that is not deferred adds each `nn.Linear` weight gradient into `.grad` inside its GEMM "
        "(`addmm_`) from the second slice of a step on, instead of writing a fresh gradient that autograd then "
        "adds: one pass over a weight-sized tensor less per Linear and slice (fp32 biases on an accelerator too, "
        "with `addmv_`). The same sum up to the order of the additions. Not used where DeepSpeed hooks the "
        "accumulation (ZeRO with contiguous gradients or overlapped reduction, bf16 `immediate_grad_update`) or "
        "with `shard_params`; set `false` if your own "
        "hooks must see every accumulation (a `register_post_accumulate_grad_hook` is respected either way)"))
    """Add the weight (and fp32 bias) gradients of ``nn.Linear`` modules into ``.grad`` inside their GEMMs during
    training (runtime/slicing/deferred.py ``enable_fused_grad_accumulation``). The engine uses it only where nothing
    hooks the accumulation into ``.grad``; ``false`` keeps autograd's accumulation everywhere."""

    vocab_parallel: bool = Field(False, description=(
        "split the output layer and the input embedding (tied or not) by vocabulary rows over the pipeline ranks "
        "([Vocabulary parallelism](vocab_parallel.md)); build the module with `vocab_parallel=True` "
        "(`**ds_terapipe.module_chunk_kwargs(terapipe)`); every schedule, the virtual-stage ones included (the "
        "passes follow the last chunk and chunk 0 to the ranks the placement puts them on); any precision, ZeRO "
        "0/1, with `freeze`; `loss_fn=causal_lm_loss`"))
    """Split the output layer (and its gradient and optimizer state) by vocabulary rows over the pipeline ranks,
    so the last stage stops being the slowest (``runtime/features/vocab.py``). Per (micro-batch, slice) every rank
    joins two collectives (the last stage's hidden states and labels out, softmax statistics, the hidden-state gradient
    back); the loss is exactly the unsharded cross entropy. The input embedding is split too, sharing the head's
    rows when tied, with rows of its own when not (``runtime/features/vocab_embedding.py``: two more collectives per
    unit). Needs ``loss_fn=causal_lm_loss`` and an output layer as the last layer; any precision and ZeRO stage
    0/1; works with every schedule, virtual stages included (the passes follow the last chunk and chunk 0 wherever
    the placement puts them); build the model with
    ``TokenPipelineModule(..., vocab_parallel=True)`` (and the same ``virtual_stages`` and ``schedule``)."""

    packed: bool = Field(False, description=(
        "batches may hold packed documents: `((input_ids, position_ids), labels)`, position ids restarting at 0 "
        "where each document starts (Hugging Face's `DataCollatorWithFlattening` convention); attention stays "
        "within each document, also across slices, and positions restart per document; every slice's activations "
        "carry its position ids to the next stage. `(input_ids, labels)` is one document per row ([Packed "
        "documents](models.md#packed-documents))"))
    """Batches may hold packed documents: ``((input_ids, position_ids), labels)``, position ids restarting at 0
    where each document starts (Hugging Face's ``DataCollatorWithFlattening`` convention). Attention then stays
    within each document, also across slices, and positions restart per document (runtime/slicing/documents.py);
    every slice's activations carry its position ids to the next stage. A batch ``(input_ids, labels)`` is one
    document per row. Off: a tuple of inputs goes to the first layer as it is."""

    plan_per_batch: bool = Field(False, description=(
        'with `packed` and `slices: "auto"`: plan each training step\'s slicing for the documents of its rows, '
        "from the costs measured at init (a slice attends over its own document's prefix only, so where documents "
        "end moves the best cuts); memoised by document layout, one all-reduce and one broadcast per step; measured "
        "no faster than a fixed plan on a realistic corpus ([Planning packed rows](models.md#planning-packed-rows))"))
    """Plan every training step's slicing for its rows' documents (``runtime/planning/batch_plan.py``): the first
    stages reduce their micro-batches' position ids to the document context at each grid start, rank 0 plans from
    the measured costs (memoised by layout) and broadcasts the slices. Needs ``packed`` and ``slices: "auto"``;
    not with ``replan`` or ``freeze``, which install plans of their own."""

    sequence_parallel: int = Field(1, ge=1, description=(
        "sequence-parallel ranks per stage (Ulysses inside the token pipeline): every slice's tokens split N ways, "
        "all-to-alls around attention; the launcher's world is stages x N x data-parallel replicas; build the "
        "module with `sequence_parallel=N` (`**ds_terapipe.module_chunk_kwargs(terapipe)`); slice lengths "
        "multiples of N, heads and KV heads divisible by N ([Sequence parallelism](sequence_parallel.md))"))
    """Sequence-parallel ranks per pipeline stage (``runtime/slicing/sequence.py``): each slice's tokens split
    ``N`` ways over the stage's sequence group, position-wise layers on the rank's share, two all-to-alls around
    :func:`~ds_terapipe.sliced_causal_attention` (the whole slice for 1/N of the heads, KV carry per head
    subset), gradients summed over the group; ``slices: "auto"`` profiles each rank's share with its all-to-alls.
    fp32, fp16 and bf16 at ZeRO stage 0 and 1; with ``replan``, ``plan_per_batch``, ``freeze`` (and its repack),
    ``vocab_parallel`` and ``packed``, each tested against the unsliced reference (docs/sequence_parallel.md); not
    with ``shard_params``."""

    shard_params: bool = Field(False, description=(
        "shard each chunk's parameters, gradients and optimizer state over the data-parallel replicas (torch's "
        "FSDP2 per chunk): a chunk is all-gathered when the schedule starts a run of its actions and freed after "
        "it, its gradients reduce-scattered once per run, so `looped-bfs` gathers at most twice per chunk and "
        "step whatever the micro-batch count ([Sharded data parallelism](sharding.md)); ZeRO stage 0, fp32 or bf16, "
        "a torch optimizer; not with `vocab_parallel`, `freeze`, `sequence_parallel` or `deferred_weight_grads`"))
    """Fully sharded data parallelism per chunk (``runtime/features/sharding.py``): the schedule's ``AG``/``RS``/``RL``
    actions (``planner/sharding.py``) gather a chunk before a run of its actions and reduce-scatter the run's
    gradients after it. A weight tied across layers is a sharded group of its own, gathered with the chunks that use
    it."""

    shard_prefetch: bool = Field(True, description=(
        "with `shard_params`: start the all-gather of a rank's next run when its current run starts (overlapped, "
        "two chunks gathered at a time); off: gather when the run starts (one chunk at a time)"))

    shard_release: Literal["run", "step"] = Field("run", description=(
        "with `shard_params`: `\"run\"` frees a chunk after each run of the schedule on it (Breadth-First Pipeline "
        "Parallelism's policy: least memory; `looped-bfs` gathers a chunk for its forwards and again for its "
        "backwards); `\"step\"` keeps it whole from its first run to its last of the step (one gather and one "
        "reduce-scatter per chunk and step, every chunk of the rank whole at once, as torch's pipelining keeps "
        "FSDP2 modules)"))

    max_slices: Optional[int] = Field(None, ge=1, description='upper bound on the number of slices `"auto"` may choose')

    memory_limit_gb: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description=(
        'per-stage budget for activations + KV caches; `"auto"` rejects plans estimated above it'))

    plan_cache: Optional[str] = Field(None, min_length=1, description=(
        "directory for plans, keyed by everything that determines them (model shapes, topology, batch, schedule, "
        "device, profile settings); a restart skips profiling (and re-times one slice length instead: "
        "`profile.recheck_cached`)"))
    """Directory where plans are stored, keyed by everything that determines them; a restart skips profiling."""

    resume_plan: bool = Field(True, description=(
        "with `slices: \"auto\"`, `load_checkpoint` runs the slicing the checkpoint's run was using (its plans at "
        "the save, after any freeze or re-plan switch, for every sequence length it had planned) instead of what "
        "this start profiled and would plan, when the plan's shape (stages, micro-batches, batch, schedule) and the "
        "planning keys above are unchanged; logged either way. `false`: keep this start's plan (a run moved to "
        "another kind of machine)"))
    """With ``slices: "auto"``, ``load_checkpoint`` runs the slicing the checkpoint's run was using (its plans at
    the save, for every sequence length it had planned: the init plan, or what a freeze or the re-planner
    switched to) when the shapes and planning keys are unchanged, so a resumed run continues exactly as it would
    have; the plan profiled at this start is dropped (logged). ``false``: keep this start's plan (moving a run to
    another kind of machine)."""

    p2p_timeout_s: float = Field(300.0, gt=0, le=1e9, allow_inf_nan=False, description=(
        "a rank waiting longer than this for a pipeline peer fails with the instruction it was stuck on (a dead "
        "process; a peer that raised stops the others within about a second instead, see "
        "[Faults](training.md#training-for-days-data-parallelism-variable-lengths-checkpoints-faults))"))
    """Seconds a rank waits for a pipeline peer before failing with the instruction it was stuck on."""

    trace_dir: Optional[str] = Field(None, min_length=1, description=(
        "every rank writes a Chrome trace of each training batch (measured start/end of each forward and backward "
        "per micro-batch and slice), in the simulator's format; merge ranks with `ds_terapipe.trace.merge_traces`"))
    """Directory where every rank writes a Chrome trace of each training batch: when each forward and backward
    of each (micro-batch, slice) started and ended, in the simulator's format (merge the ranks' files with
    ``ds_terapipe.trace.merge_traces``; times share the host clock, so ranks on one machine line up)."""

    profile: ProfileConfig = Field(ProfileConfig(), description=(
        'how each stage measures its own layers when `slices` is `"auto"` (its keys below)'))
    """Profiling settings for ``slices: "auto"``."""

    replan: ReplanConfig = Field(ReplanConfig(), description=(
        "online re-planning from measured step timelines (its keys below; off unless `replan.enabled`)"))
    """Online re-planning from measured step timelines (off by default)."""

    freeze: Optional[FreezeConfig] = Field(None, description=(
        "progressive freezing of the front layers, off without this section; exactly one policy: `freeze.schedule` "
        "or `freeze.auto` (its keys below)"))
    """Progressive freezing of the front layers (off by default; see :class:`FreezeConfig`)."""

    @field_validator("schedule")
    @classmethod
    def _check_schedule(cls, value: str) -> str:
        try:
            get_schedule(value)
        except ValueError:
            raise ValueError(f"terapipe.schedule={value!r} is unknown; use one of {', '.join(schedule_names())} "
                             "(ds-terapipe schedules describes them)") from None
        return value

    @field_validator("slices", mode="before")
    @classmethod
    def _check_slices(cls, value: Any) -> Any:
        ok_list = isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in value)
        if isinstance(value, bool) or not (value == "auto" or isinstance(value, int) or ok_list):
            raise ValueError(f"terapipe.slices={value!r}: use \"auto\", a positive int or a list of token counts")
        if isinstance(value, int) and value < 1:
            raise ValueError(f"terapipe.slices={value} must be >= 1 (or \"auto\", or a list of token counts)")
        if isinstance(value, list):
            if not value or any(n < 1 for n in value):
                raise ValueError(f"terapipe.slices={value}: a list needs at least one slice, every count >= 1")
        return value

    def _check_sharding(self) -> None:
        clash = [name for name, on in (("vocab_parallel", self.vocab_parallel), ("freeze", self.freeze is not None),
                                       ("sequence_parallel", self.sequence_parallel > 1),
                                       ("deferred_weight_grads", bool(self.deferred_weight_grads))) if on]
        if clash:
            raise ValueError(f"terapipe.shard_params shards each chunk's states over the data-parallel replicas and "
                             f"is not supported with {', '.join(clash)} (their gradients bypass the per-chunk "
                             "reduce-scatter); turn those off, or shard_params off")

    def _check_profile_lengths(self) -> None:
        lengths = self.profile.slice_lengths
        off_grid = [n for n in lengths or () if n < 1 or n % self.granularity]
        if off_grid:
            raise ValueError(f"terapipe.profile.slice_lengths={lengths}: every length must be a positive multiple of "
                             f"terapipe.granularity={self.granularity} (the grid the planner cuts slices on), got "
                             f"{off_grid}; use multiples of {self.granularity} or drop the key for the default")
        too_long = [n for n in lengths or () if self.seq_len is not None and n > self.seq_len]
        if too_long:
            raise ValueError(f"terapipe.profile.slice_lengths={lengths}: a slice holds at most terapipe.seq_len="
                             f"{self.seq_len} tokens, got {too_long}; use lengths up to {self.seq_len} or drop the key "
                             "for the default")

    @model_validator(mode="after")
    def _check_consistency(self) -> "TeraPipeConfig":
        spec = get_schedule(self.schedule)
        self._check_profile_lengths()
        if self.replan.enabled and self.slices != "auto":
            raise ValueError(f"terapipe.replan.enabled needs slices \"auto\" (re-planning refits the costs an "
                             f"\"auto\" plan was made from), got slices={self.slices!r}; set slices to \"auto\" or "
                             "disable replan")
        for key, value in (("max_slices", self.max_slices), ("memory_limit_gb", self.memory_limit_gb)):
            if value is not None and self.slices != "auto":
                raise ValueError(f"terapipe.{key}={value!r} bounds the slicing \"auto\" chooses, but slices="
                                 f"{self.slices!r} is fixed, so it would be ignored; set slices to \"auto\" or drop "
                                 f"{key}")
        if self.plan_per_batch:
            needs = [why for why, bad in (("packed: true", not self.packed), ('slices: "auto"', self.slices != "auto"),
                                          ("no replan", self.replan.enabled), ("no freeze", self.freeze is not None))
                     if bad]
            if needs:
                raise ValueError(f"terapipe.plan_per_batch plans each step's slicing for its packed documents from "
                                 f"the measured costs, and needs {', '.join(needs)} (re-planning and freezing "
                                 "install plans of their own); set those, or plan_per_batch to false")
        if self.sequence_parallel > 1:
            n = self.sequence_parallel
            odd = [t for t in self.slices if t % n] if isinstance(self.slices, list) else []
            if odd or (not isinstance(self.slices, list) and self.granularity % n):
                raise ValueError(f"terapipe.sequence_parallel={n} splits every slice's tokens {n} ways: slice "
                                 f"lengths must be multiples of {n}, got "
                                 f"{f'slices {self.slices}' if odd else f'granularity {self.granularity}'}; use "
                                 f"lengths (or a granularity) divisible by {n}")
        if self.shard_params:
            self._check_sharding()
        if self.deferred_weight_grads is None:
            self.deferred_weight_grads = spec.deferred_weight_grads and not self.shard_params
        if self.virtual_stages is None:
            self.virtual_stages = spec.virtual_stages
        try:
            spec.placement(2, self.virtual_stages)  # the rule does not depend on the number of ranks
        except ValueError as err:
            raise ValueError(f"terapipe.virtual_stages={self.virtual_stages} with schedule {self.schedule!r}: {err}") \
                from None
        if isinstance(self.slices, list):
            total = sum(self.slices)
            if self.seq_len is None:
                self.seq_len = total
            elif total != self.seq_len:
                raise ValueError(f"terapipe.slices={self.slices} sum to {total} but terapipe.seq_len={self.seq_len}; "
                                 "make the slice lengths add up to seq_len")
            return self
        if self.enabled and self.seq_len is None:
            raise ValueError(f"terapipe.seq_len is required with terapipe.slices={self.slices!r}: set it to the "
                             "number of tokens per sequence")
        if self.seq_len is not None and self.seq_len % self.granularity != 0:
            raise ValueError(f"terapipe.granularity={self.granularity} does not divide terapipe.seq_len="
                             f"{self.seq_len}; pick a granularity that divides it (e.g. 1) or pad the sequences")
        if isinstance(self.slices, int) and self.seq_len is not None and \
                self.slices > self.seq_len // self.granularity:
            raise ValueError(f"terapipe.slices={self.slices} is more than seq_len/granularity = "
                             f"{self.seq_len // self.granularity}; use fewer slices or a smaller granularity")
        return self

    @property
    def slicing(self) -> SlicingPolicy:
        """``slices`` as a :class:`SlicingPolicy` (the one place the union is decoded after validation)."""
        if isinstance(self.slices, list):
            return SlicingPolicy("fixed", self.granularity, lengths=tuple(self.slices))
        if isinstance(self.slices, int):
            return SlicingPolicy("equal", self.granularity, count=self.slices)
        return SlicingPolicy("auto", self.granularity)

    def equal_slices(self, seq_len: Optional[int] = None) -> List[int]:
        """Token counts for ``slices: n`` over ``seq_len`` (default: ``self.seq_len``): multiples of granularity,
        as equal as possible, larger first; fewer than n if the sequence has fewer granularity units."""
        seq_len = self.seq_len if seq_len is None else seq_len
        assert isinstance(self.slices, int) and seq_len is not None
        return list(self.slicing.fixed_for(seq_len) or ())


#: nested sections by their path under "terapipe", for the valid keys of an unknown one
_SECTIONS: dict[tuple[str, ...], type[DeepSpeedConfigModel]] = {
    ("profile", ): ProfileConfig, ("replan", ): ReplanConfig, ("freeze", ): FreezeConfig,
    ("freeze", "auto"): AutoFreezeConfig}

#: pydantic error types for range constraints -> the rule in the message (``ctx`` holds the bound).
_RULES = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
          "less_than": ("<", "lt")}


def parse_terapipe_config(ds_config: dict) -> TeraPipeConfig:
    """Read and validate the ``"terapipe"`` section of a DeepSpeed config dict (absent: disabled).

    Raises:
        ValueError: one line naming the key, the value and the rule or pydantic's reason (for an unknown key: the
            valid keys).
    """
    section = ds_config.get(TERAPIPE_KEY, {})
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ValueError(f"DeepSpeed config key {TERAPIPE_KEY!r} must be an object, got {type(section).__name__}")
    try:
        return TeraPipeConfig(strict=True, **section)
    except ValidationError as err:
        raise ValueError(_one_message(err)) from None


def _one_message(err: ValidationError) -> str:
    """pydantic's report as the one line users get: unknown keys first (all of them, with the valid ones), else
    the first error as ``terapipe.<key>=<value> <rule>``."""
    errors = err.errors()
    unknown = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        parent = unknown[0][:-1]
        model: type[DeepSpeedConfigModel] = _SECTIONS.get(tuple(map(str, parent)), TeraPipeConfig)
        keys = sorted(str(loc[-1]) for loc in unknown if loc[:-1] == parent)
        where = ".".join((TERAPIPE_KEY, *map(str, parent)))
        return f"{where}: unknown key(s) {keys}; valid keys are {sorted(model.model_fields)}"
    first = errors[0]
    message = first.get("msg", str(err)).removeprefix("Value error, ")
    if message.startswith(TERAPIPE_KEY):
        return message
    where = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith(("literal[", "list[")))
    rule = _RULES.get(first["type"])
    if rule is not None:
        bound = f"{rule[0]} {first['ctx'][rule[1]]:g}"
        return (f"{TERAPIPE_KEY}.{where}={first.get('input')!r} must be {bound}; set a value {bound} or drop the "
                "key for the default")
    return (f"{TERAPIPE_KEY}.{where}={first.get('input')!r}: {message}; set a valid value or drop the key for the "
            "default")
