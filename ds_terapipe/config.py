"""The ``"terapipe"`` section of the DeepSpeed JSON config.

Example::

    "terapipe": {"enabled": true, "seq_len": 1024, "slices": "auto", "schedule": "1f1b",
                 "plan_cache": "runs/plans"}

Validated once, with DeepSpeed's own config base class, so it reads like any other DeepSpeed section.
Unknown keys are refused with the list of valid ones (a typo must not silently fall back to a default).
"""

from __future__ import annotations

from typing import Any, List, Literal, Optional, Union

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import ValidationError, field_validator, model_validator

__all__ = ["ProfileConfig", "TeraPipeConfig", "parse_terapipe_config", "TERAPIPE_KEY"]

TERAPIPE_KEY = "terapipe"


class ProfileConfig(DeepSpeedConfigModel):
    """How each stage measures its own layers when ``slices`` is ``"auto"``."""

    slice_lengths: Optional[List[int]] = None
    """Slice lengths (tokens) to time at context 0; default: powers of two from ``granularity`` to ``seq_len``
    (at most 6 of them), which brackets every slice the planner may pick."""

    num_contexts: int = 3
    """How many prefix lengths (spread over ``[0, seq_len)``) to time per slice length, for the context term."""

    warmup: int = 1
    """Untimed rounds over the grid before the timed ones (first calls allocate)."""

    repeats: int = 3
    """Timed rounds over the grid; each point keeps its median. Three, so the median rejects one disturbed sample
    (the median of two is their mean)."""

    @field_validator("num_contexts", "repeats")
    @classmethod
    def _positive(cls, value: int, info) -> int:
        if value < 1:
            raise ValueError(f"terapipe.profile.{info.field_name}={value} must be >= 1")
        return value

    @field_validator("warmup")
    @classmethod
    def _non_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"terapipe.profile.warmup={value} must be >= 0")
        return value


class TeraPipeConfig(DeepSpeedConfigModel):
    """Token-level pipeline settings (the ``"terapipe"`` section of the DeepSpeed config)."""

    enabled: bool = False
    """Turn token-level pipelining on. Off: ``ds_terapipe.initialize`` is exactly ``deepspeed.initialize``."""

    seq_len: Optional[int] = None
    """Tokens per sequence the plan is made for. Required unless ``slices`` is a list (then its sum)."""

    slices: Union[Literal["auto"], int, List[int]] = "auto"
    """``"auto"``: profile each stage at engine init and let the planner choose; an int n: n equal slices
    (multiples of ``granularity``, the remainder spread over the first slices); a list: exact token counts."""

    granularity: int = 8
    """Slice lengths are multiples of this many tokens (keeps kernels efficient and the planner fast)."""

    schedule: Literal["gpipe", "1f1b"] = "gpipe"
    """``gpipe``: all forwards, then all backwards (TeraPipe). ``1f1b``: token-level 1F1B, bounded memory."""

    deferred_weight_grads: Optional[bool] = None
    """Backward of a slice computes input gradients only and sends them on; the ``nn.Linear`` weight gradients
    follow in a ``W`` action (runtime/deferred.py), so the previous stage gets its gradients sooner. With
    ``gpipe`` one W per micro-batch after its last backward (its Linear inputs and output gradients wait until
    then); with ``1f1b`` one W per slice right after the send (one slice's pairs wait). Default (None): on with
    ``gpipe``; off with ``1f1b``, whose point is bounded memory (per-slice W measured +5-30% activations)."""

    max_slices: Optional[int] = None
    """Upper bound on the number of slices ``"auto"`` may choose."""

    memory_limit_gb: Optional[float] = None
    """Per-stage memory budget for activations + KV caches; ``"auto"`` rejects plans estimated above it."""

    plan_cache: Optional[str] = None
    """Directory where plans are stored, keyed by everything that determines them; a restart skips profiling."""

    p2p_timeout_s: float = 300.0
    """Seconds a rank waits for a pipeline peer before failing with the instruction it was stuck on."""

    trace_dir: Optional[str] = None
    """Directory where every rank writes a Chrome trace of each training batch: when each forward and backward
    of each (micro-batch, slice) started and ended, in the simulator's format (merge the ranks' files with
    ``ds_terapipe.trace.merge_traces``; times share the host clock, so ranks on one machine line up)."""

    profile: ProfileConfig = ProfileConfig()
    """Profiling settings for ``slices: "auto"``."""

    @field_validator("seq_len", "granularity", "max_slices")
    @classmethod
    def _positive_int(cls, value: Optional[int], info) -> Optional[int]:
        if value is not None and value < 1:
            raise ValueError(f"terapipe.{info.field_name}={value} must be >= 1")
        return value

    @field_validator("memory_limit_gb", "p2p_timeout_s")
    @classmethod
    def _positive_float(cls, value: Optional[float], info) -> Optional[float]:
        if value is not None and not value > 0:
            raise ValueError(f"terapipe.{info.field_name}={value} must be > 0")
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
        if self.deferred_weight_grads is None:
            self.deferred_weight_grads = self.schedule == "gpipe"
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


def _check_keys(section: dict, model: type[DeepSpeedConfigModel], prefix: str) -> None:
    valid = sorted(model.model_fields)
    unknown = sorted(set(section) - set(valid))
    if unknown:
        raise ValueError(f"{prefix}: unknown key(s) {unknown}; valid keys are {valid}")


def parse_terapipe_config(ds_config: dict) -> TeraPipeConfig:
    """Read and validate the ``"terapipe"`` section of a DeepSpeed config dict (absent: disabled).

    Raises:
        ValueError: naming the key, the value and the fix.
    """
    section = ds_config.get(TERAPIPE_KEY, {})
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ValueError(f"DeepSpeed config key {TERAPIPE_KEY!r} must be an object, got {type(section).__name__}")
    _check_keys(section, TeraPipeConfig, TERAPIPE_KEY)
    if isinstance(section.get("profile"), dict):
        _check_keys(section["profile"], ProfileConfig, f"{TERAPIPE_KEY}.profile")
    try:
        return TeraPipeConfig(strict=True, **section)
    except ValidationError as err:
        first = err.errors()[0]
        message = first.get("msg", str(err)).removeprefix("Value error, ")
        if message.startswith(TERAPIPE_KEY):
            raise ValueError(message) from None
        where = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith(("literal[", "list[")))
        raise ValueError(f"{TERAPIPE_KEY}.{where}={first.get('input')!r}: {message}") from None
