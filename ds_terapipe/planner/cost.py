"""Cost models: how long one slice of tokens takes on one pipeline stage.

The slicing DP (``slicing.py``) needs the time t(s, c) of a slice of ``s`` tokens that follows a prefix of ``c``
tokens, for every candidate slice, on every stage. Later slices attend over a longer prefix, so t grows with c (up
to the window, under sliding-window attention); tiny slices underuse the device, so t(s, 0) / s falls with s. Two
models provide t:

* ``MeasuredCost`` fits points profiled on the real device (the engine profiles each stage at init). The fit
  follows TeraPipe (ICML 2021, eq. 9): a context-free part t0(s), interpolated over the measured slice
  lengths, plus a context part ``a0 + a1*s + a2*c + a3*s*c`` least-squares fitted to ``t - t0(s)`` on the points
  with c > 0. Unlike the reference implementation the context part is *not* added at c = 0, so the model
  returns the measured t0(s) exactly there instead of counting the intercept twice; and it is never negative
  (a prefix does not make a slice cheaper), which keeps a noisy fit from promising free slices.
* ``AnalyticCost`` derives t kernel by kernel from the FLOPs and bytes of a transformer layer on a device
  (``roofline.py``; devices and models in ``presets.py``), for planning before any hardware is at hand.

``PipelineCost`` holds one model per stage and reads/writes the public JSON file format documented in
``docs/cost_format.md``. This module imports numpy and the standard library only.
"""
from __future__ import annotations

import copy
import json
import math
import logging
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

from ._checks import check_int, check_number
from .roofline import DeviceSpec, Roofline, TransformerSpec
from .step_cost import StepCost

logger = logging.getLogger(__name__)

__all__ = [
    "StageCost",
    "ChunkCostView",
    "MeasuredCost",
    "TransformerSpec",
    "DeviceSpec",
    "AnalyticCost",
    "PipelineCost",
    "VocabShareCost",
    "WithVocabShare",
    "CostFileError",
    "load_cost_file",
    "read_cost_json",
    "WEIGHT_KEYS",
    "per_stage_cost",
    "scaled_cost",
]

#: Scalars or numpy arrays; every cost method broadcasts its arguments against each other like a ufunc.
ArrayLike = Union[int, float, np.ndarray, Sequence[float]]

_POINT_KEYS = ("batch", "slice", "context", "forward_ms", "backward_ms")
_COMM_KEYS = ("latency_ms", "gbps")
#: the deferred weight-gradient terms of a stage object: W of one slice of s tokens = per_slice + per_token * s
WEIGHT_KEYS = ("weight_ms_per_token", "weight_ms_per_slice")
_STAGE_KEYS = ("points", "comm", "hidden", "bytes_per_element", *WEIGHT_KEYS)
_TOP_KEYS = ("points", "stages", "comm", "hidden", "bytes_per_element", *WEIGHT_KEYS, "num_stages", "meta", "step",
             "vocab")
#: the ``vocab`` object: one rank's measured vocabulary-parallel share and the pipeline's collective links
_VOCAB_KEYS = ("points", "num_ranks", "hidden", "latency_ms", "gbps", "bytes_per_element", "split_embedding")


def _result(x: np.ndarray) -> Any:
    """0-d results come back as numpy float64 (a ``float``), arrays as arrays."""
    return x[()] if x.ndim == 0 else x


def comm_time_ms(latency_ms: float, gbps: float | None, num_bytes: ArrayLike) -> np.ndarray:
    """A transfer of ``num_bytes`` over a link of ``gbps`` Gbit/s after ``latency_ms`` (just the latency without
    a bandwidth)."""
    num_bytes = np.asarray(num_bytes, dtype=float)
    # gbps is in Gbit/s: bytes / (gbps * 1e9 / 8) seconds = bytes * 8 / (gbps * 1e6) milliseconds.
    if gbps is None:
        return np.full(num_bytes.shape, float(latency_ms))
    return latency_ms + num_bytes * 8.0 / (gbps * 1e6)


class StageCost(ABC):
    """Time of one pipeline unit (a slice of a (sub)batch) on one stage, in milliseconds.

    Methods broadcast ``slice_len``, ``context`` and ``batch`` like numpy ufuncs, so the planner can fill its whole
    (start, end) table in one call. Arguments are not validated here (this is the hot path); the planner only asks
    for ``slice_len >= 1``, ``context >= 0``, ``batch >= 1``.
    """

    @abstractmethod
    def forward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        """Forward time of ``slice_len`` tokens after ``context`` cached tokens, for ``batch`` sequences."""

    @abstractmethod
    def backward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        """Backward time of the same unit (includes the gradient flowing into the cached prefix)."""

    @abstractmethod
    def comm_ms(self, slice_len: ArrayLike, batch: ArrayLike = 1) -> Any:
        """Point-to-point time to send this unit's activations to the next stage."""

    def weight_ms(self, tokens: ArrayLike, batch: ArrayLike = 1) -> Any:
        """Deferred weight-gradient work of ONE ``W`` pass over ``tokens`` tokens per sequence.

        0 unless the model was measured with deferred weight gradients: then ``backward_ms`` is the
        input-gradient part only and this is the rest. The runtime computes a pass as one GEMM per Linear over
        all the tokens it covers (a slice's for a W per slice, the micro-batch's for a W per micro-batch), so a
        pass reads each weight once whatever the slicing: the simulator asks ``weight_ms(slice)`` for a W per
        slice and ``weight_ms(seq_len)`` for a W covering the micro-batch.
        """
        return _result(np.zeros(np.broadcast_shapes(np.shape(tokens), np.shape(batch))))

    def covers(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike | None = None) -> bool:
        """Whether every (slice_len, context) lies inside the data the model was built from (else extrapolated)."""
        return True

    def cache_key(self) -> Hashable:
        """Equal keys mean identical costs; lets the planner evaluate shared stage models once."""
        return ("id", id(self))


# --------------------------------------------------------------------------------------------------------------
# Validation helpers: every message names the field, the value and the fix.

def _check_keys(obj: Any, valid: Sequence[str], where: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise TypeError(f"{where} must be a JSON object (dict), got {type(obj).__name__}; fix the file layout")
    for key in obj:
        if key not in valid:
            raise ValueError(f"{where} has unknown key {key!r}; valid keys: {', '.join(valid)}")
    return obj


def _number(value: Any, where: str, *, positive: bool = False) -> float:
    """A measured time or rate from a cost file: finite, >= 0 (> 0 if ``positive``)."""
    return check_number(value, where, positive=positive, fix="write a finite JSON number (fix the measurement or "
                                                            "drop it)")


# --------------------------------------------------------------------------------------------------------------
# MeasuredCost

def _interp_linear(x: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    """Piecewise-linear through (xp, fp), extended linearly by the end segments (not held flat: time keeps
    growing with slice length). A single measured length is scaled proportionally, t(s) = t(s0) * s / s0."""
    if len(xp) == 1:
        return fp[0] * x / xp[0]
    y = np.interp(x, xp, fp)
    lo_slope = (fp[1] - fp[0]) / (xp[1] - xp[0])
    hi_slope = (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
    y = np.where(x < xp[0], fp[0] + (x - xp[0]) * lo_slope, y)
    return np.where(x > xp[-1], fp[-1] + (x - xp[-1]) * hi_slope, y)


def _fit_context(s: np.ndarray, c: np.ndarray, r: np.ndarray, warn: bool) -> np.ndarray:
    """Least squares r ~ a0 + a1*s + a2*c + a3*s*c (columns scaled for conditioning). Min-norm if rank < 4."""
    if len(s) == 0:
        return np.zeros(4)
    x = np.stack([np.ones_like(s), s, c, s * c], axis=1)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _, rank, _ = np.linalg.lstsq(x / scale, r, rcond=None)
    if warn and rank < 4:
        logger.warning("context fit is rank-deficient (rank %d of 4 from %d points with context > 0); "
                       "measure more distinct (slice, context) pairs for a reliable fit", rank, len(s))
    return coef / scale


@dataclass
class _BatchFit:
    """The fitted model for one measured batch size."""

    s0: np.ndarray          # (n0,) distinct slice lengths measured at context 0, ascending
    t0: np.ndarray          # (2, n0) forward / backward mean time at those lengths
    coef: np.ndarray        # (2, 4) context-term coefficients for forward / backward
    s_min: float
    s_max: float
    c_max: float

    @classmethod
    def fit(cls, pts: np.ndarray, warn: bool) -> _BatchFit:
        """``pts``: (n, 5) rows (batch, slice, context, forward, backward) of a single batch size."""
        s, c, times = pts[:, 1], pts[:, 2], pts[:, 3:5].T
        zero = c == 0
        s0, inverse = np.unique(s[zero], return_inverse=True)
        counts = np.bincount(inverse)
        t0 = np.stack([np.bincount(inverse, weights=t[zero]) / counts for t in times])
        ctx = ~zero
        coef = np.stack([_fit_context(s[ctx], c[ctx], t[ctx] - _interp_linear(s[ctx], s0, t0[k]), warn)
                         for k, t in enumerate(times)])
        return cls(s0, t0, coef, float(s0[0]), float(s0[-1]), float(c.max()))

    def eval(self, kind: int, s: np.ndarray, c: np.ndarray) -> np.ndarray:
        t = _interp_linear(s, self.s0, self.t0[kind])
        a = self.coef[kind]
        # A prefix never makes a slice cheaper: a noisy fit (its intercept a0 is poorly determined when the
        # contexts measured are long) can go negative for short contexts, which once made the planner cut a
        # sequence into 30 slices of 8 tokens that it believed cost nothing. The context part is clamped at 0.
        t = t + np.where(c > 0, np.maximum(a[0] + a[1] * s + a[2] * c + a[3] * s * c, 0.0), 0.0)
        return np.maximum(t, 0.0)  # an extrapolated fit must never promise negative time


class MeasuredCost(StageCost):
    """A stage's cost fitted to profiled points (see the module docstring for the model).

    ``points`` are mappings with keys ``slice``, ``context``, ``forward_ms``, ``backward_ms`` and optional
    ``batch`` (default 1), exactly as in the cost file. Each measured batch size gets its own fit; a batch size
    that was not measured is scaled linearly from the nearest measured one (ties: the larger one), t(b) =
    t(b') * b / b' -- an approximation that is exact only when the device is saturated, so profile the batch you
    will run. Outside the measured slice range t0 is extrapolated linearly; ``covers`` tells callers when.
    ``comm`` is ``{"latency_ms": ..., "gbps": ...}`` (Gbit/s); without it sending costs nothing, which is right
    for a single stage and optimistic otherwise. ``hidden`` and ``bytes_per_element`` size a slice's activations
    (batch * slice * hidden * bytes_per_element bytes) and are required when ``gbps`` is given.
    ``weight_ms_per_token`` and ``weight_ms_per_slice``: when the points were measured with deferred weight
    gradients (``backward_ms`` without the ``nn.Linear`` weight gradients), the deferred pass of one slice of s
    tokens costs ``weight_ms_per_slice + weight_ms_per_token * s`` per sequence (the fixed part: every GEMM
    reads its weight once per slice, whatever the slice's length).
    ``position_wise``: the layers mix no tokens (the output layer's vocabulary share), so points at context 0 are
    complete; otherwise a batch without a point at context > 0 is warned about (attention over the prefix unseen).
    """

    def __init__(self, points: Sequence[Mapping[str, Any]], *, comm: Mapping[str, Any] | None = None,
                 hidden: int | None = None, bytes_per_element: int = 2, weight_ms_per_token: float | None = None,
                 weight_ms_per_slice: float | None = None, where: str = "cost", position_wise: bool = False) -> None:
        if isinstance(points, (str, bytes)) or not isinstance(points, Sequence) or len(points) == 0:
            raise ValueError(f"{where}.points = {points!r:.60} must be a non-empty list of measured points; "
                             "profile at least one slice length at context 0")
        rows = []
        for i, p in enumerate(points):
            w = f"{where}.points[{i}]"
            _check_keys(p, _POINT_KEYS, w)
            for key in _POINT_KEYS[1:]:
                if key not in p:
                    raise ValueError(f"{w} is missing {key!r}; each point needs slice, context, forward_ms, "
                                     "backward_ms (and optionally batch)")
            rows.append((check_int(p.get("batch", 1), f"{w}.batch", minimum=1, wrong_type=ValueError),
                         check_int(p["slice"], f"{w}.slice", minimum=1, wrong_type=ValueError),
                         check_int(p["context"], f"{w}.context", minimum=0, wrong_type=ValueError),
                         _number(p["forward_ms"], f"{w}.forward_ms"),
                         _number(p["backward_ms"], f"{w}.backward_ms")))
        self._points = np.array(rows, dtype=float)  # (n, 5)
        self.comm = None if comm is None else dict(_check_keys(comm, _COMM_KEYS, f"{where}.comm"))
        self._latency_ms = 0.0 if comm is None else _number(comm.get("latency_ms", 0.0), f"{where}.comm.latency_ms")
        gbps = None if comm is None or comm.get("gbps") is None else comm["gbps"]
        self._gbps = None if gbps is None else _number(gbps, f"{where}.comm.gbps", positive=True)
        self.hidden = None if hidden is None else check_int(hidden, f"{where}.hidden", minimum=1,
                                                            wrong_type=ValueError)
        self.bytes_per_element = check_int(bytes_per_element, f"{where}.bytes_per_element", minimum=1,
                                           wrong_type=ValueError)
        self.weight_ms_per_token = None if weight_ms_per_token is None else \
            _number(weight_ms_per_token, f"{where}.weight_ms_per_token")
        self.weight_ms_per_slice = None if weight_ms_per_slice is None else \
            _number(weight_ms_per_slice, f"{where}.weight_ms_per_slice")
        if self._gbps is not None and self.hidden is None:
            raise ValueError(f"{where}.comm.gbps = {gbps!r} needs the activation size: add \"hidden\" (the model "
                             "width) next to \"comm\"")
        self._fits: dict[int, _BatchFit] = {}
        for b in np.unique(self._points[:, 0]).astype(int):
            pts = self._points[self._points[:, 0] == b]
            if not np.any(pts[:, 2] == 0):
                raise ValueError(f"{where}.points has no context = 0 point for batch {b}; measure at least one "
                                 "slice length with context 0 at that batch")
            if not position_wise and not np.any(pts[:, 2] > 0):
                logger.warning("%s: no point with context > 0 for batch %d: the cost ignores attention over the "
                               "prefix; profile some contexts", where, b)
            self._fits[int(b)] = _BatchFit.fit(pts, warn=True)
        self._batches = np.array(sorted(self._fits), dtype=float)
        self._key: Hashable | None = None

    # -- evaluation --------------------------------------------------------------------------------------------
    def _nearest(self, b: float) -> int:
        d = np.abs(self._batches - b)
        return int(self._batches[np.flatnonzero(d == d.min())[-1]])

    def _eval(self, kind: int, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike) -> Any:
        if np.ndim(batch) == 0:
            # no explicit broadcast: a (1, N) row of lengths and an (N, 1) column of contexts interpolate t0 on
            # N values, not N^2 (the planner's table)
            s, c = np.asarray(slice_len, float), np.asarray(context, float)
            near = self._nearest(float(batch))  # type: ignore[arg-type]
            t = self._fits[near].eval(kind, s, c) * (float(batch) / near)  # type: ignore[arg-type]
            return _result(np.broadcast_to(t, np.broadcast_shapes(s.shape, c.shape)).copy()
                           if t.shape != np.broadcast_shapes(s.shape, c.shape) else t)
        s, c, b = np.broadcast_arrays(np.asarray(slice_len, float), np.asarray(context, float),
                                      np.asarray(batch, float))
        out = np.empty(s.shape)
        for bv in np.unique(b):
            mask = b == bv
            near = self._nearest(bv)
            out[mask] = self._fits[near].eval(kind, s[mask], c[mask]) * (bv / near)
        return _result(out)

    def forward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return self._eval(0, slice_len, context, batch)

    def backward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return self._eval(1, slice_len, context, batch)

    def comm_ms(self, slice_len: ArrayLike, batch: ArrayLike = 1) -> Any:
        s, b = np.broadcast_arrays(np.asarray(slice_len, float), np.asarray(batch, float))
        if self.comm is None:
            return _result(np.zeros(s.shape))
        num_bytes = b * s * float(self.hidden or 0) * self.bytes_per_element
        return _result(comm_time_ms(self._latency_ms, self._gbps, num_bytes))

    def weight_ms(self, tokens: ArrayLike, batch: ArrayLike = 1) -> Any:
        rate, fixed = self.weight_ms_per_token or 0.0, self.weight_ms_per_slice or 0.0
        s = np.asarray(tokens, float)
        return _result((rate * s + np.where(s > 0, fixed, 0.0)) * np.asarray(batch, float))

    def covers(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike | None = None) -> bool:
        fit = self._fits[self._nearest(1.0 if batch is None else float(np.max(batch)))]
        s, c = np.asarray(slice_len, float), np.asarray(context, float)
        return bool(np.all((s >= fit.s_min) & (s <= fit.s_max) & (c <= fit.c_max)))

    def cache_key(self) -> Hashable:
        if self._key is None:  # the object is immutable after construction, so compute once
            self._key = ("measured", json.dumps(self.to_dict(), sort_keys=True))
        return self._key

    # -- reporting and serialisation ----------------------------------------------------------------------------
    def fit_report(self) -> dict[str, Any]:
        """Leave-one-out relative error of the fit, forward and backward.

        Each point is dropped in turn, its batch size refitted and the point predicted; |pred - true| / true is
        averaged. Points whose removal leaves their batch without a context-0 point are skipped (counted in
        ``num_skipped``). Held-out points at the ends of the range are extrapolated, which is the honest test.
        """
        errors: list[list[float]] = [[], []]
        skipped = 0
        for b in self._fits:
            pts = self._points[self._points[:, 0] == b]
            for i in range(len(pts)):
                rest = np.delete(pts, i, axis=0)
                if not np.any(rest[:, 2] == 0):
                    skipped += 1
                    continue
                fit = _BatchFit.fit(rest, warn=False)
                for kind in (0, 1):
                    pred = float(fit.eval(kind, pts[i:i + 1, 1], pts[i:i + 1, 2])[0])
                    true = pts[i, 3 + kind]
                    errors[kind].append(abs(pred - true) / max(true, 1e-12))

        def summary(e: list[float]) -> dict[str, float]:
            return {"mean_rel_err": float(np.mean(e)) if e else float("nan"),
                    "max_rel_err": float(np.max(e)) if e else float("nan")}

        return {"method": "leave-one-out", "forward": summary(errors[0]), "backward": summary(errors[1]),
                "num_held_out": len(errors[0]), "num_skipped": skipped}

    def to_dict(self) -> dict[str, Any]:
        """The per-stage object of the cost file; ``MeasuredCost.from_dict(x.to_dict())`` predicts identically."""
        out: dict[str, Any] = {"points": [
            {"batch": int(r[0]), "slice": int(r[1]), "context": int(r[2]), "forward_ms": float(r[3]),
             "backward_ms": float(r[4])} for r in self._points]}
        if self.comm is not None:
            out["comm"] = dict(self.comm)
        if self.hidden is not None:
            out["hidden"] = self.hidden
        out["bytes_per_element"] = self.bytes_per_element
        if self.weight_ms_per_token is not None:
            out["weight_ms_per_token"] = self.weight_ms_per_token
        if self.weight_ms_per_slice is not None:
            out["weight_ms_per_slice"] = self.weight_ms_per_slice
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any], where: str = "cost", position_wise: bool = False) -> MeasuredCost:
        """Parse one per-stage object of the cost file (keys: points, comm, hidden, bytes_per_element,
        weight_ms_per_token, weight_ms_per_slice)."""
        _check_keys(obj, _STAGE_KEYS, where)
        if "points" not in obj:
            raise ValueError(f"{where} has no \"points\"; add the measured points (see docs/cost_format.md)")
        return cls(obj["points"], comm=obj.get("comm"), hidden=obj.get("hidden"),
                   bytes_per_element=obj.get("bytes_per_element", 2),
                   weight_ms_per_token=obj.get("weight_ms_per_token"),
                   weight_ms_per_slice=obj.get("weight_ms_per_slice"), where=where, position_wise=position_wise)


def per_stage_cost(cost: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the cost-file dict ``cost`` with one ``"stages"`` entry per stage (chunk).

    Why: ``PipelineCost.to_dict`` writes equal stages once (``"points"`` and the stage keys at the top, with
    ``"num_stages"``), which is what every single-chunk engine profiles and caches; code that scales or reads the
    stages one by one takes this form, where each stage is its own object."""
    out = copy.deepcopy(dict(cost))
    if "stages" not in out:
        shared = {key: out.pop(key) for key in _STAGE_KEYS if key in out}
        out["stages"] = [copy.deepcopy(shared) for _ in range(int(out.get("num_stages") or 1))]
    return out


def scaled_cost(cost: Mapping[str, Any], scales: Mapping[int, Mapping[str, float]]) -> dict[str, Any]:
    """A copy of the cost-file dict ``cost`` whose stage c has its forward, backward and weight-gradient times
    multiplied by ``scales[c]["F"]``, ``["B"]`` and ``["W"]`` (a stage or kind not given keeps its scale): what
    re-planning's refit and a plan-cache recheck apply. Returned with one ``"stages"`` entry per stage
    (:func:`per_stage_cost`), since the scales may differ between stages."""
    out = per_stage_cost(cost)
    for chunk, stage in enumerate(out["stages"]):
        scale = {"F": 1.0, "B": 1.0, "W": 1.0, **scales.get(chunk, {})}
        for point in stage.get("points", ()):
            point["forward_ms"] *= scale["F"]
            point["backward_ms"] *= scale["B"]
        for key in WEIGHT_KEYS:
            if key in stage:
                stage[key] *= scale["W"]
    return out


# --------------------------------------------------------------------------------------------------------------
# AnalyticCost

class AnalyticCost(StageCost):
    """Roofline cost of ``num_layers`` transformer blocks of ``model`` on ``device`` (physics: ``roofline.py``):
    the blocks ``[first_layer, first_layer + num_layers)``, whose sliding windows (``TransformerSpec.window``) set
    what each block's attention costs.

    Per block and slice (b sequences, s new tokens after c cached ones, m = b*s):
      forward   = sum over Linears of GEMM(m, in, out) + attention(s, c, window) + small ops + per_layer_overhead
      backward  = dX GEMMs + attention backward + small ops' backward, and, unless ``deferred_weight_grads``,
                  the weight-gradient GEMMs and their addition into ``.grad`` (see ``accumulate_ms``)
      weight_ms = with ``deferred_weight_grads``: the weight-gradient GEMMs of ONE pass over ``tokens`` tokens,
                  the copy that lays several slices end to end, and one addition into ``.grad``; else 0
    where a GEMM costs max(2*m*in*out / (peak * efficiency), (in*out + m*(in+out)) * bytes / (bandwidth *
    bandwidth_efficiency), kernel_launch): its weight is read (or its gradient written) whole, whatever m, which
    is what bounds a short slice. With ``lm_head`` the stage also runs the vocabulary projection (a GEMM of h x
    vocab) and the softmax/loss (4*b*s*vocab elements); with ``embedding`` the input embedding: a gather forward
    (2*b*s*h elements) and a backward that writes a dense (vocab, h) gradient and adds it into ``.grad`` per call,
    so per slice (PyTorch's dense embedding backward; the embedding is not a Linear and is never deferred). Comm
    is the device link: latency + b*s*h*bytes_per_element / bandwidth.
    """

    def __init__(self, model: TransformerSpec, device: DeviceSpec, num_layers: int, *,
                 bytes_per_element: int = 2, lm_head: bool = False, embedding: bool = False,
                 deferred_weight_grads: bool = False, first_layer: int = 0) -> None:
        if not isinstance(model, TransformerSpec):
            raise TypeError(f"model must be a TransformerSpec, got {type(model).__name__}; see presets.py")
        if not isinstance(device, DeviceSpec):
            raise TypeError(f"device must be a DeviceSpec, got {type(device).__name__}; see presets.py")
        self.model, self.device = model, device
        self.num_layers = check_int(num_layers, "num_layers", minimum=0, wrong_type=ValueError)
        self.first_layer = check_int(first_layer, "first_layer", minimum=0, wrong_type=ValueError,
                                     fix="give the index of the stage's first block in the model")
        # (window, blocks): blocks of one window cost the same, so a stage is costed once per distinct window
        self.windows = model.window_counts(self.first_layer, self.num_layers)
        self.bytes_per_element = check_int(bytes_per_element, "bytes_per_element", minimum=1,
                                           wrong_type=ValueError)
        self.lm_head, self.embedding = bool(lm_head), bool(embedding)
        self.deferred_weight_grads = bool(deferred_weight_grads)
        self._roof = Roofline(model, device, self.bytes_per_element)

    def _args(self, *xs: ArrayLike) -> list[np.ndarray]:
        # not broadcast against each other: a (1, N) row of lengths and an (N, 1) column of contexts cost the GEMMs
        # (which see only b * s) on N values, not N^2. The result still has the full shape: attention (forward,
        # backward) sees s, c and b, and weight_ms' GEMMs s and b.
        return [np.asarray(x, float) for x in xs]

    @staticmethod
    def _zeros(s: np.ndarray, c: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The blocks' sum starts here: the result has the full shape of s, c and b even without blocks."""
        return np.zeros(np.broadcast_shapes(s.shape, c.shape, b.shape))

    def _head_io(self, m: np.ndarray, backward: bool = False) -> np.ndarray:
        # logits written, read by the softmax/loss, its gradient written and read: 4 * m * vocab elements
        return self._roof.small_ops(4, 4.0 * m * self.model.vocab * self._roof.e, backward=backward)

    def forward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        s, c, b = self._args(slice_len, context, batch)
        roof, m = self._roof, b * s
        t = sum((n * roof.layer_forward_ms(s, c, b, w) for w, n in self.windows), self._zeros(s, c, b))
        if self.lm_head:
            t = t + roof.gemm(m, self.model.hidden, self.model.vocab) + self._head_io(m)
        if self.embedding:
            t = t + roof.small_ops(1, 2.0 * m * self.model.hidden * roof.e)
        return _result(t)

    def backward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        s, c, b = self._args(slice_len, context, batch)
        roof, m, h, v = self._roof, b * s, self.model.hidden, self.model.vocab
        t = sum((n * (roof.layer_input_grad_ms(s, c, b, w) + roof.norm_accumulate_ms()) for w, n in self.windows),
                self._zeros(s, c, b))
        if not self.deferred_weight_grads:
            t = t + self.num_layers * (roof.layer_weight_grad_ms(m) + roof.linear_accumulate_ms())
        if self.lm_head:
            t = t + roof.gemm(m, v, h, backward=True) + self._head_io(m, backward=True)
            if not self.deferred_weight_grads:
                t = t + roof.gemm(m, h, v, backward=True) + roof.accumulate_ms(h * v, 1)
        if self.embedding:   # a dense (vocab, h) gradient: zeroed, tokens' rows added, added into .grad
            t = t + roof.small_ops(2, (h * v + 2.0 * m * h) * roof.e, backward=True) + roof.accumulate_ms(h * v, 1)
        return _result(t)

    def weight_ms(self, tokens: ArrayLike, batch: ArrayLike = 1) -> Any:
        """The deferred weight gradients of ONE ``W`` pass over ``tokens`` tokens per sequence (one GEMM per
        Linear over them all, whether they were one slice or several); 0 without ``deferred_weight_grads``
        (``backward_ms`` then holds them). Not additive over slices: the fixed part (each GEMM writes its whole
        gradient, which is then added into ``.grad``) is paid once per pass."""
        s, b = self._args(tokens, batch)
        if not self.deferred_weight_grads:
            return _result(np.zeros(np.broadcast_shapes(s.shape, b.shape)))
        roof, m, h, v = self._roof, b * s, self.model.hidden, self.model.vocab
        t = self.num_layers * (roof.layer_weight_grad_ms(m, backward=False) + roof.gather_ms(m)
                               + roof.linear_accumulate_ms())
        if self.lm_head:
            t = t + roof.gemm(m, h, v) + roof.accumulate_ms(h * v, 1)
        return _result(np.where(s > 0, t, 0.0))

    def accumulate_ms(self) -> float:
        """What adding one pass's weight gradients into ``.grad`` costs (in ``backward_ms`` without deferral, in
        ``weight_ms`` with it). The first pass after ``zero_grad(set_to_none=True)`` does not pay it: autograd
        takes that gradient as ``.grad`` instead of adding it."""
        roof, h, v = self._roof, self.model.hidden, self.model.vocab
        t = self.num_layers * (roof.linear_accumulate_ms() + roof.norm_accumulate_ms())
        if self.lm_head:
            t += roof.accumulate_ms(h * v, 1)
        if self.embedding:
            t += roof.accumulate_ms(h * v, 1)
        return float(t)

    def comm_ms(self, slice_len: ArrayLike, batch: ArrayLike = 1) -> Any:
        s, b = np.broadcast_arrays(np.asarray(slice_len, float), np.asarray(batch, float))
        num_bytes = b * s * self.model.hidden * self.bytes_per_element
        return _result(comm_time_ms(self.device.link_latency_ms, self.device.link_gbps, num_bytes))

    def cache_key(self) -> Hashable:
        return ("analytic", self.model, self.device, self.num_layers, self.windows, self.bytes_per_element,
                self.lm_head, self.embedding, self.deferred_weight_grads)


class VocabShareCost(StageCost):
    """One rank's share of a vocabulary-parallel LM head: ``head / num_ranks`` plus the per-slice collectives.

    Collectives among the p ranks of a pipeline over a link of ``link_latency_ms`` and ``link_gbps`` (Gbit/s):
    each costs ceil(log2 p) latencies plus 2(p-1)/p of its bytes over the link (a ring's volume). Forward: the
    hidden states and labels (b*s*h*bytes_per_element + b*s*8) broadcast from the last stage, then one all-reduce
    of every rank's (max, sum of exp, target logit) in fp32 (p*b*s*12 bytes: each rank's row, the others zeros).
    Backward: the hidden-state gradient reduced to the last stage. ``comm_ms`` is 0 (the share sends nothing along
    the pipeline itself). ``head_is_shard``: ``head`` is one rank's shard as measured on it (the runtime's
    cost-based partition), not divided by ``num_ranks``.
    ``split_embedding``: a tied input embedding split with the head adds EF (token ids, int64, broadcast; the
    partial embeddings reduced) and EB (the embedding's gradient broadcast) per slice.
    """

    def __init__(self, head: StageCost, num_ranks: int, hidden: int, *, link_latency_ms: float, link_gbps: float,
                 bytes_per_element: int = 2, head_is_shard: bool = False, split_embedding: bool = False) -> None:
        self.head = head
        self.head_is_shard = bool(head_is_shard)  # the head cost is one rank's shard already (timed on it)
        self.split_embedding = bool(split_embedding)
        self.num_ranks = check_int(num_ranks, "num_ranks", fix="pass the pipeline ranks the head is split over")
        self.hidden = check_int(hidden, "hidden", fix="pass the model width")
        self.latency = check_number(link_latency_ms, "link_latency_ms", fix="pass the link latency in ms")
        self.gbps = check_number(link_gbps, "link_gbps", positive=True, fix="pass the link bandwidth in Gbit/s")
        self.bytes_per_element = check_int(bytes_per_element, "bytes_per_element", fix="use 2 (16 bit) or 4")

    @property
    def _divisor(self) -> int:
        return 1 if self.head_is_shard else self.num_ranks

    def _collective(self, num_bytes: np.ndarray) -> np.ndarray:
        p = self.num_ranks
        if p == 1:
            return np.zeros_like(num_bytes)
        return math.ceil(math.log2(p)) * self.latency + 2.0 * (p - 1) / p * num_bytes * 8.0 / (self.gbps * 1e6)

    def _pass_collectives(self, kind: str, slice_len: ArrayLike, batch: ArrayLike) -> Any:
        """The collectives of one pass of a slice: VF the broadcast of the hidden states and labels and one all-reduce
        (every rank's fp32 max, sum of exp and target logit), VB the hidden gradient's reduce; with the split
        embedding EF the ids' broadcast and the partial lookups' reduce, EB the embedding gradient's broadcast (else
        nothing)."""
        tokens = np.asarray(slice_len, float) * np.asarray(batch, float)
        hidden = self._collective(tokens * self.hidden * self.bytes_per_element)
        if kind == "VF":
            return self._collective(tokens * (self.hidden * self.bytes_per_element + 8.0)) + \
                self._collective(tokens * 12.0 * self.num_ranks)
        if kind == "VB":
            return hidden
        if kind not in ("EF", "EB"):
            raise ValueError(f"pass_ms: kind {kind!r} is not a vocabulary pass; use 'VF', 'VB', 'EF' or 'EB'")
        if not self.split_embedding:
            return np.zeros_like(tokens)
        return hidden + self._collective(tokens * 8.0) if kind == "EF" else hidden

    def collective_ms(self, slice_len: ArrayLike, batch: ArrayLike = 1, backward: bool = False) -> Any:
        """The collectives' time of one slice (forward: a broadcast and an all-reduce; backward: one reduce), with
        the split embedding's (EF, EB) added."""
        kinds = ("VB", "EB") if backward else ("VF", "EF")
        return sum(self._pass_collectives(k, slice_len, batch) for k in kinds)

    def pass_ms(self, kind: str, slice_len: ArrayLike, batch: ArrayLike = 1) -> Any:
        """One vocabulary pass of a slice as the schedule runs it: ``"VF"`` (the shard's logits and softmax
        statistics, the hidden states' broadcast, two all-reduces), ``"VB"`` (the shard's gradients, the hidden
        gradient's reduce), ``"EF"`` (token ids broadcast, partial lookups reduced) and ``"EB"`` (the embedding
        gradient's broadcast). ``VF + EF`` is :meth:`forward_ms` at context 0, ``VB + EB`` :meth:`backward_ms`;
        the shard's arithmetic (its lookup and row gradient too) is charged to VF and VB."""
        comm = self._pass_collectives(kind, slice_len, batch)
        if kind == "VF":
            return np.asarray(self.head.forward_ms(slice_len, 0, batch)) / self._divisor + comm
        if kind == "VB":
            return np.asarray(self.head.backward_ms(slice_len, 0, batch)) / self._divisor + comm
        return comm

    def to_dict(self) -> dict[str, Any]:
        """The cost file's ``vocab`` object (a measured shard only; ``PipelineCost.from_dict`` reads it back)."""
        if not isinstance(self.head, MeasuredCost) or not self.head_is_shard:
            raise TypeError("VocabShareCost.to_dict needs a measured shard (MeasuredCost, head_is_shard=True)")
        return {"points": self.head.to_dict()["points"], "num_ranks": self.num_ranks, "hidden": self.hidden,
                "latency_ms": self.latency, "gbps": self.gbps, "bytes_per_element": self.bytes_per_element,
                "split_embedding": self.split_embedding}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any], where: str = "cost.vocab") -> VocabShareCost:
        _check_keys(obj, _VOCAB_KEYS, where)
        missing = [k for k in _VOCAB_KEYS if k not in obj]
        if missing:
            raise ValueError(f"{where} lacks {missing}; it needs {list(_VOCAB_KEYS)} (one rank's measured shard)")
        head = MeasuredCost.from_dict({"points": obj["points"]}, where=where, position_wise=True)
        return cls(head, obj["num_ranks"], obj["hidden"], link_latency_ms=obj["latency_ms"], link_gbps=obj["gbps"],
                   bytes_per_element=obj["bytes_per_element"], head_is_shard=True,
                   split_embedding=bool(obj["split_embedding"]))

    def forward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return np.asarray(self.head.forward_ms(slice_len, context, batch)) / self._divisor + \
            self.collective_ms(slice_len, batch)

    def backward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return np.asarray(self.head.backward_ms(slice_len, context, batch)) / self._divisor + \
            self.collective_ms(slice_len, batch, backward=True)

    def comm_ms(self, slice_len: ArrayLike, batch: ArrayLike = 1) -> Any:
        return np.zeros(np.broadcast_shapes(np.shape(slice_len), np.shape(batch)))[()]

    def covers(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike | None = None) -> bool:
        return self.head.covers(slice_len, context, batch)

    def cache_key(self) -> Hashable:
        return ("vocab-share", self.head.cache_key(), self.num_ranks, self.hidden, self.latency, self.gbps,
                self.bytes_per_element, self.head_is_shard, self.split_embedding)


class ChunkCostView(StageCost):
    """A chunk's cost seen through one change (the vocabulary passes' share added, contexts read per document,
    tokens split over sequence ranks): every term a view does not redefine is the chunk's own, the deferred
    weight-gradient work (``weight_ms``) and attributes such as ``deferred_weight_grads`` included."""

    def __init__(self, chunk: StageCost) -> None:
        self.chunk = chunk

    def __getattr__(self, name: str) -> Any:
        chunk = self.__dict__.get("chunk")   # absent while copy or pickle rebuilds the object
        if chunk is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(chunk, name)

    def forward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return self.chunk.forward_ms(slice_len, context, batch)

    def backward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return self.chunk.backward_ms(slice_len, context, batch)

    def comm_ms(self, slice_len: ArrayLike, batch: ArrayLike = 1) -> Any:
        return self.chunk.comm_ms(slice_len, batch)

    def weight_ms(self, tokens: ArrayLike, batch: ArrayLike = 1) -> Any:
        return self.chunk.weight_ms(tokens, batch)

    def covers(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike | None = None) -> bool:
        return self.chunk.covers(slice_len, context, batch)


class WithVocabShare(ChunkCostView):
    """A chunk's cost with ``weight`` of every rank's vocabulary passes added to its forward and backward: how
    the slicer sees vocabulary parallelism (each rank runs VF + EF and VB + EB once per slice, whatever its
    chunk count, so with v chunks per rank each chunk carries 1/v). Everything else is the chunk's own (the passes
    have no deferred weight-gradient work: their gradients are computed by hand in VB)."""

    def __init__(self, chunk: StageCost, share: VocabShareCost, weight: float = 1.0) -> None:
        super().__init__(chunk)
        self.share, self.weight = share, float(weight)

    def forward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return np.asarray(self.chunk.forward_ms(slice_len, context, batch)) + \
            self.weight * np.asarray(self.share.forward_ms(slice_len, context, batch))

    def backward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return np.asarray(self.chunk.backward_ms(slice_len, context, batch)) + \
            self.weight * np.asarray(self.share.backward_ms(slice_len, context, batch))

    def covers(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike | None = None) -> bool:
        return self.chunk.covers(slice_len, context, batch) and self.share.covers(slice_len, context, batch)

    def cache_key(self) -> Hashable:
        return ("with-vocab-share", self.chunk.cache_key(), self.share.cache_key(), self.weight)


# --------------------------------------------------------------------------------------------------------------
# PipelineCost and the file format

class PipelineCost:
    """One ``StageCost`` per chunk of the model (per pipeline stage when each stage holds one chunk); the
    planner's and simulator's view of the hardware. The file format names the list ``stages``.

    ``step``: what a training step costs besides the slices (:class:`~ds_terapipe.planner.step_cost.StepCost`:
    per-action fixed costs, optimizer, gradient reductions, end-of-step sync); None: nothing (the older model).
    ``vocab``: with vocabulary parallelism, every rank's share of the output layer and its collectives
    (:class:`VocabShareCost`): the simulator costs the ``VF``/``VB``/``EF``/``EB`` actions with it.
    """

    def __init__(self, stages: Sequence[StageCost], *, meta: Mapping[str, Any] | None = None,
                 step: StepCost | None = None, vocab: VocabShareCost | None = None) -> None:
        stages = list(stages)
        if not stages:
            raise ValueError("PipelineCost needs at least one stage cost; pass a non-empty list")
        for i, st in enumerate(stages):
            if not isinstance(st, StageCost):
                raise TypeError(f"stages[{i}] is a {type(st).__name__}, not a StageCost; wrap it in "
                                "MeasuredCost or AnalyticCost")
        self.stages: list[StageCost] = stages
        self.meta: dict[str, Any] | None = None if meta is None else dict(meta)
        if step is not None and not isinstance(step, StepCost):
            raise TypeError(f"step must be a StepCost, got {type(step).__name__}; parse it with StepCost.from_dict")
        self.step: StepCost | None = step
        if vocab is not None and not isinstance(vocab, VocabShareCost):
            raise TypeError(f"vocab must be a VocabShareCost, got {type(vocab).__name__}")
        self.vocab: VocabShareCost | None = vocab

    @property
    def num_chunks(self) -> int:
        """The model pieces costed: the pipeline's stages, or with virtual stages its chunks."""
        return len(self.stages)

    def chunk(self, c: int) -> StageCost:
        """The cost of chunk ``c`` (with one chunk per stage, of stage ``c``)."""
        if not 0 <= c < len(self.stages):
            raise IndexError(f"chunk {c} out of range for a cost of {len(self.stages)} chunks")
        return self.stages[c]

    def folded_vocab(self, virtual_stages: int = 1) -> PipelineCost:
        """This cost with the vocabulary passes folded into every chunk (1/v of a rank's per chunk) and no
        ``vocab`` term: for planners that cost chunk by chunk on schedules without the passes. Itself without a
        ``vocab``."""
        if self.vocab is None:
            return self
        weight = 1.0 / virtual_stages
        return PipelineCost([WithVocabShare(st, self.vocab, weight) for st in self.stages], meta=self.meta,
                            step=self.step)

    @property
    def has_weight_terms(self) -> bool:
        """Whether a stage was measured with deferred weight gradients (``weight_ms_per_token`` or
        ``weight_ms_per_slice``) or is an ``AnalyticCost`` built with ``deferred_weight_grads``: its
        ``backward_ms`` then leaves them out, so the cost only describes a step when the schedule carries the
        ``W`` actions (``deferred_weight_grads``); without them that work vanishes."""
        return any(getattr(st, key, None) is not None for st in self.stages for key in WEIGHT_KEYS) or \
            any(getattr(st, "deferred_weight_grads", False) for st in self.stages)

    def is_uniform(self) -> bool:
        """True when every stage has the same cost, so the planner's closed form is exact for GPipe."""
        first = self.stages[0].cache_key()
        return all(st is self.stages[0] or st.cache_key() == first for st in self.stages[1:])

    def covers(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike | None = None) -> bool:
        """False if any stage would extrapolate beyond its measurements for these (slice_len, context)."""
        return all(st.covers(slice_len, context, batch) for st in self.stages)

    @classmethod
    def uniform(cls, stage_cost: StageCost, num_stages: int) -> PipelineCost:
        """The same cost on every stage (a model split into equal stages on equal devices)."""
        num_stages = check_int(num_stages, "num_stages", minimum=1, wrong_type=ValueError)
        return cls([stage_cost] * num_stages)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any], num_stages: int | None = None) -> PipelineCost:
        """Parse the public cost format (``docs/cost_format.md``).

        ``{"points": [...]}`` gives every stage the same cost; their number is ``num_stages`` (argument or
        top-level key, which must agree), else 1. ``{"stages": [{...}, ...]}`` gives one cost per stage; its
        length must equal ``num_stages`` when that is given. Top-level ``comm``, ``hidden`` and
        ``bytes_per_element`` are defaults that a stage object's own keys override.
        """
        _check_keys(obj, _TOP_KEYS, "cost")
        if num_stages is not None:
            num_stages = check_int(num_stages, "num_stages", minimum=1, wrong_type=ValueError)
        if "num_stages" in obj:
            n_file = check_int(obj["num_stages"], "cost.num_stages", minimum=1, wrong_type=ValueError)
            if num_stages is not None and n_file != num_stages:
                raise ValueError(f"cost.num_stages = {n_file} but num_stages = {num_stages} was requested; "
                                 "use a cost file for this pipeline depth")
            num_stages = n_file
        meta = obj.get("meta")
        if meta is not None and not isinstance(meta, Mapping):
            raise ValueError(f"cost.meta = {meta!r:.60} must be a JSON object; use {{}} or drop it")
        step = StepCost.from_dict(obj["step"]) if obj.get("step") is not None else None
        vocab = VocabShareCost.from_dict(obj["vocab"]) if obj.get("vocab") is not None else None
        defaults = {k: obj[k] for k in ("comm", "hidden", "bytes_per_element", *WEIGHT_KEYS) if k in obj}
        if ("points" in obj) == ("stages" in obj):
            raise ValueError("cost needs exactly one of \"points\" (same cost on every stage) or \"stages\" "
                             f"(one object per stage), got keys {sorted(obj)}; see docs/cost_format.md")
        if "points" in obj:
            stage = MeasuredCost.from_dict({**defaults, "points": obj["points"]}, where="cost")
            return cls([stage] * (num_stages or 1), meta=meta, step=step, vocab=vocab)
        stage_objs = obj["stages"]
        if not isinstance(stage_objs, list) or not stage_objs:
            raise ValueError(f"cost.stages = {stage_objs!r:.60} must be a non-empty list of stage objects")
        if num_stages is not None and len(stage_objs) != num_stages:
            raise ValueError(f"cost.stages has {len(stage_objs)} entries but num_stages = {num_stages}; give one "
                             "entry per stage or use \"points\" for equal stages")
        stages = []
        for i, st in enumerate(stage_objs):
            _check_keys(st, _STAGE_KEYS, f"cost.stages[{i}]")
            stages.append(MeasuredCost.from_dict({**defaults, **st}, where=f"cost.stages[{i}]"))
        return cls(stages, meta=meta, step=step, vocab=vocab)

    def to_dict(self) -> dict[str, Any]:
        """The cost file for this pipeline (MeasuredCost stages only); ``from_dict`` of it round-trips exactly."""
        for i, st in enumerate(self.stages):
            if not isinstance(st, MeasuredCost):
                raise TypeError(f"to_dict needs MeasuredCost stages, stage {i} is {type(st).__name__}; "
                                "profile it or sample it into points first")
        out: dict[str, Any]
        if self.is_uniform():
            out = {**self.stages[0].to_dict(), "num_stages": self.num_chunks}  # type: ignore[union-attr]
        else:
            out = {"stages": [st.to_dict() for st in self.stages], "num_stages": self.num_chunks}  # type: ignore
        if self.meta is not None:
            out["meta"] = dict(self.meta)
        if self.step is not None:
            out["step"] = self.step.to_dict()
        if self.vocab is not None:
            out["vocab"] = self.vocab.to_dict()
        return out

    def __repr__(self) -> str:
        kinds = sorted({type(st).__name__ for st in self.stages})
        return f"PipelineCost(num_chunks={self.num_chunks}, {'uniform' if self.is_uniform() else 'unequal'}, " \
               f"{'/'.join(kinds)})"


class CostFileError(ValueError):
    """A cost file that cannot be read or parsed. ``reason`` is the message without the path, for callers that
    name the file their own way (the CLI's ``--cost FILE``)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"cost file {str(path)!r}: {reason}")
        self.path, self.reason = path, reason


def read_cost_json(path: str | Path) -> Any:
    """The JSON value in a cost file; CostFileError (a ValueError) with the error position if it is malformed."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise CostFileError(path, f"cannot read the file ({exc.strerror or exc}); check the path") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CostFileError(path, f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); fix "
                                  "the file") from exc


def load_cost_file(path: str | Path, num_stages: int | None = None) -> PipelineCost:
    """Read a cost file; malformed JSON raises ValueError with the path and the error position."""
    path = Path(path)
    obj = read_cost_json(path)
    try:
        return PipelineCost.from_dict(obj, num_stages=num_stages)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{path}: {exc}") from exc
