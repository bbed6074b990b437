"""The ``"terapipe"`` section of the DeepSpeed JSON config.

Example::

    "terapipe": {"enabled": true, "seq_len": 1024, "slices": "auto", "schedule": "1f1b",
                 "plan_cache": "runs/plans"}

Validated once, with DeepSpeed's own config base class, so it reads like any other DeepSpeed section: unknown
keys are refused by pydantic (the base's ``extra="forbid"``; a typo must not silently fall back to a default)
and ranges are field constraints. :func:`parse_terapipe_config` turns pydantic's report into one line naming
the key, the value and the rule, and lists the valid keys for an unknown one. Allowed ``schedule`` values and
the default for ``deferred_weight_grads`` come from the schedule registry (``planner/registry.py``).
"""

from __future__ import annotations

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

    slice_lengths: Optional[List[int]] = None
    """Slice lengths (tokens) to time at context 0; default: powers of two from ``granularity`` to ``seq_len``
    (at most 6 of them), which brackets every slice the planner may pick."""

    num_contexts: int = Field(3, ge=1)
    """How many prefix lengths (spread over ``[0, seq_len)``) to time per slice length, for the context term."""

    warmup: int = Field(1, ge=0)
    """Untimed rounds over the grid before the timed ones (first calls allocate)."""

    repeats: int = Field(3, ge=1)
    """Timed rounds over the grid; each point keeps its median. Three, so the median rejects one disturbed sample
    (the median of two is their mean)."""

    recheck_cached: bool = True
    """On a plan-cache hit, time the plan's median slice length again (about a second per stage) and, when the
    device now runs more than 5% faster or slower than the cached costs (a shared host under other load, another
    host of the same type), rescale them and solve again: the plan and its predicted step match this run's
    speed. Not part of the cache key."""


class ReplanConfig(DeepSpeedConfigModel):
    """Online re-planning (``runtime/planning/replan.py``): after warm-up, refit the cost model to measured action times
    and switch to a better slicing when it pays; all ranks switch at the same step, results do not change."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    """Re-plan once from measurements (needs ``slices: "auto"``: a plan from the config is the user's)."""

    warmup_steps: int = Field(5, ge=0)
    """Training steps before measuring: the first steps allocate and warm caches (measured with the example
    trainer: its first 4-5 steps run 5-40% slower than the later ones, and a refit from them overestimates)."""

    measure_steps: int = Field(3, ge=1)
    """Training steps whose timelines are summed for the refit."""

    min_gain: float = Field(0.03, ge=0.0)
    """Switch only when the refit model predicts the new slicing at least this much faster (0.03: 3%)."""


class AutoFreezeConfig(DeepSpeedConfigModel):
    """The automatic freezing policy (``runtime/features/freeze.py``, as in PipeTransformer): every ``check_interval``
    steps each still-training layer's gradient norm is measured (after the data-parallel reduction, before the
    optimizer step). A layer is *stable* when its norm changed by at most ``tolerance`` (relative) since the
    previous check. The stable layers in a row right behind the frozen prefix freeze, at most
    ``max(1, floor(aggressiveness x training layers))`` of them per check; a layer that is not stable stops the
    run (front to back only), and nothing ever unfreezes. Layers count DeepSpeed's layer list (global indices, as
    in checkpoint files), those without parameters ride along with the layer in front of them."""

    model_config = ConfigDict(extra="forbid")

    check_interval: int = Field(10, ge=1)
    """Training steps between two gradient-norm checks (the first check only records)."""

    warmup_steps: int = Field(0, ge=0)
    """No check before this many steps (gradients of the first steps move a lot)."""

    tolerance: float = Field(0.1, gt=0.0)
    """A layer is stable when ``|norm - previous norm| / previous norm <= tolerance`` between two checks."""

    aggressiveness: float = Field(0.5, gt=0.0, le=1.0)
    """The fraction of the still-training layers (with parameters) one check may freeze (at least one): PipeTransformer's
    alpha. 1.0 freezes every stable layer in a row at once."""

    max_frozen_layers: Optional[int] = Field(None, ge=1)
    """Never freeze beyond this many layers (default: all but the last layer with parameters)."""


class FreezeConfig(DeepSpeedConfigModel):
    """Progressive freezing of the front layers (``runtime/features/freeze.py``): frozen layers run forward only, take no
    backward and no weight gradient, their optimizer state is released; ranks whose layers are all frozen get no
    gradient. Exactly one policy: ``schedule`` or ``auto``."""

    model_config = ConfigDict(extra="forbid")

    schedule: Optional[List[List[int]]] = None
    """``[[step, num_frozen_layers], ...]``: from training step ``step`` (optimizer steps done before the batch)
    on, the first ``num_frozen_layers`` layers of the model (DeepSpeed's layer list, global indices) are frozen.
    Steps strictly increase and counts never decrease (a layer never unfreezes)."""

    auto: Optional[AutoFreezeConfig] = None
    """The automatic policy from per-layer gradient-norm change (see :class:`AutoFreezeConfig`)."""

    replan: bool = True
    """After each freeze, re-plan the slicing from the costs profiled at init with the frozen layers' backward
    removed (``slices: "auto"`` only; a plan from the config is the user's and stays)."""

    repack: bool = False
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


class TeraPipeConfig(DeepSpeedConfigModel):
    """Token-level pipeline settings (the ``"terapipe"`` section of the DeepSpeed config)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    """Turn token-level pipelining on. Off: ``ds_terapipe.initialize`` is exactly ``deepspeed.initialize``."""

    seq_len: Optional[int] = Field(None, ge=1)
    """Tokens per sequence the plan is made for. Required unless ``slices`` is a list (then its sum)."""

    slices: Union[Literal["auto"], int, List[int]] = "auto"
    """``"auto"``: profile each stage at engine init and let the planner choose; an int n: n equal slices
    (multiples of ``granularity``, the remainder spread over the first slices); a list: exact token counts,
    taken as given (any positive lengths summing to ``seq_len``; ``granularity`` does not apply to them)."""

    granularity: int = Field(8, ge=1)
    """Slices the engine chooses (``"auto"``, an int) are multiples of this many tokens (keeps kernels efficient
    and the planner fast); it must then divide ``seq_len`` and every batch length. Not applied to a list of
    ``slices``, which is run exactly as written."""

    schedule: str = "gpipe"
    """A registered schedule (``ds-terapipe schedules`` lists them). ``gpipe``: all forwards, then all backwards
    (TeraPipe). ``1f1b``: token-level 1F1B, bounded memory."""

    virtual_stages: Optional[int] = Field(None, ge=1)
    """Chunks per pipeline rank: the model is cut into ``pipeline stages x virtual_stages`` chunks, placed by the
    schedule (``interleaved-1f1b``, ``looped-bfs``: chunk c on rank c mod p; ``dualpipev``: chunks r and 2p-1-r).
    Build the model with the same value: ``TokenPipelineModule(..., virtual_stages=v, schedule=name)``. Default
    (None): the schedule's own, 1 for ``gpipe`` and ``1f1b``, 2 for the others."""

    deferred_weight_grads: Optional[bool] = None
    """Backward of a slice computes input gradients only and sends them on; the ``nn.Linear`` weight gradients
    follow in a ``W`` action (runtime/slicing/deferred.py), so the previous stage gets its gradients sooner. With
    ``gpipe`` one W per micro-batch after its last backward (its Linear inputs and output gradients wait until
    then); with ``1f1b`` one W per slice right after the send (one slice's pairs wait). Default (None): on with
    ``gpipe``; off with ``1f1b``, whose point is bounded memory (per-slice W measured +5-30% activations): the
    schedule's registered ``ScheduleSpec.deferred_weight_grads``."""

    vocab_parallel: bool = False
    """Split the output layer (and its gradient and optimizer state) by vocabulary rows over the pipeline ranks,
    so the last stage stops being the slowest (``runtime/features/vocab.py``). Per (micro-batch, slice) every rank joins
    two collectives (the last stage's hidden states and labels out, softmax statistics, the hidden-state gradient
    back); the loss is exactly the unsharded cross entropy. A tied head's input embedding is split with it
    (``runtime/features/vocab_embedding.py``: two more collectives per unit). Needs ``loss_fn=causal_lm_loss`` and
    an output layer as the last layer; any precision and ZeRO stage 0/1; works with every schedule, virtual stages included (the passes follow
    the last chunk and chunk 0 wherever the placement puts them); build the model with
    ``TokenPipelineModule(..., vocab_parallel=True)`` (and the same ``virtual_stages`` and ``schedule``)."""

    packed: bool = False
    """Batches may hold packed documents: ``((input_ids, position_ids), labels)``, position ids restarting at 0
    where each document starts (Hugging Face's ``DataCollatorWithFlattening`` convention). Attention then stays
    within each document, also across slices, and positions restart per document (runtime/slicing/documents.py);
    every slice's activations carry its position ids to the next stage. A batch ``(input_ids, labels)`` is one
    document per row. Off: a tuple of inputs goes to the first layer as it is."""

    max_slices: Optional[int] = Field(None, ge=1)
    """Upper bound on the number of slices ``"auto"`` may choose."""

    memory_limit_gb: Optional[float] = Field(None, gt=0)
    """Per-stage memory budget for activations + KV caches; ``"auto"`` rejects plans estimated above it."""

    plan_cache: Optional[str] = None
    """Directory where plans are stored, keyed by everything that determines them; a restart skips profiling."""

    resume_plan: bool = True
    """With ``slices: "auto"``, ``load_checkpoint`` runs the slicing the checkpoint's run was using (its plans at
    the save, for every sequence length it had planned: the init plan, or what a freeze or the re-planner
    switched to) when the shapes and planning keys are unchanged, so a resumed run continues exactly as it would
    have; the plan profiled at this start is dropped (logged). ``false``: keep this start's plan (moving a run to
    another kind of machine)."""

    p2p_timeout_s: float = Field(300.0, gt=0)
    """Seconds a rank waits for a pipeline peer before failing with the instruction it was stuck on."""

    trace_dir: Optional[str] = None
    """Directory where every rank writes a Chrome trace of each training batch: when each forward and backward
    of each (micro-batch, slice) started and ended, in the simulator's format (merge the ranks' files with
    ``ds_terapipe.trace.merge_traces``; times share the host clock, so ranks on one machine line up)."""

    profile: ProfileConfig = ProfileConfig()
    """Profiling settings for ``slices: "auto"``."""

    replan: ReplanConfig = ReplanConfig()
    """Online re-planning from measured step timelines (off by default)."""

    freeze: Optional[FreezeConfig] = None
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

    @model_validator(mode="after")
    def _check_consistency(self) -> "TeraPipeConfig":
        spec = get_schedule(self.schedule)
        if self.replan.enabled and self.slices != "auto":
            raise ValueError(f"terapipe.replan.enabled needs slices \"auto\" (re-planning refits the costs an "
                             f"\"auto\" plan was made from), got slices={self.slices!r}; set slices to \"auto\" or "
                             "disable replan")
        if self.deferred_weight_grads is None:
            self.deferred_weight_grads = spec.deferred_weight_grads
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

    def equal_slices(self, seq_len: Optional[int] = None) -> List[int]:
        """Token counts for ``slices: n`` over ``seq_len`` (default: ``self.seq_len``): multiples of granularity,
        as equal as possible, larger first; fewer than n if the sequence has fewer granularity units."""
        seq_len = self.seq_len if seq_len is None else seq_len
        assert isinstance(self.slices, int) and seq_len is not None and seq_len % self.granularity == 0
        units = seq_len // self.granularity
        n = min(self.slices, units)
        return [(units // n + (1 if i < units % n else 0)) * self.granularity for i in range(n)]


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
        ValueError: one line naming the key, the value and the rule (for an unknown key: the valid keys).
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
    return f"{TERAPIPE_KEY}.{where}={first.get('input')!r}: {message}"
