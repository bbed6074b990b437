"""Meters for pipeline benchmarks: instruction timing, activation and heap memory, foreign CPU load.

* :class:`InstructionRecorder` times every instruction a DeepSpeed ``PipelineEngine`` runs (stock and token engines
  alike) and lets a memory meter sample after each; :func:`step_summary` turns one step's records into per-rank
  forward / backward / W / receive / send / tail times, :func:`compute_events` into timeline events.
* :class:`ActivationMeter`: peak bytes autograd keeps for backward (saved-tensor hooks) plus KV buffers and the
  pairs waiting for deferred weight gradients.
* :class:`HeapMeter`: peak bytes a step allocates above its start (glibc ``mallinfo2`` after every aten op):
  what a device must fit. Tested in ``tests/test_bench_meters.py``.
* :class:`CpuMeter`: CPU used by other processes on the machine, to tell clean rounds from noisy ones.

torch is imported where a meter needs it, not at the top: a benchmark worker pins itself to its cores before it
imports torch, so that torch's threads inherit the pin.
"""
from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["KINDS", "ActivationMeter", "CpuMeter", "HeapMeter", "InstructionRecorder", "compute_events",
           "step_summary"]

#: compute instructions and their schedule-IR kind (W: deferred weight gradients of a micro-batch)
KINDS = {"ForwardPass": "F", "BackwardPass": "B", "WeightGradPass": "W"}


class _Saved:
    """What a pack hook hands autograd: the tensor, plus a finalizer that fires when autograd lets go of it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


class ActivationMeter:
    """Peak bytes of activations held for backward on this stage, plus KV cache buffers.

    Install with ``with meter:`` around ``train_batch``. Each saved tensor's storage is counted once while any
    saved reference to it is alive; parameters (weights saved by linear layers) and the KV buffers (counted
    whole via ``nbytes()`` instead) are excluded.
    """

    def __init__(self, engine: Any) -> None:
        import torch

        self.engine = engine
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
        self.live: dict[int, list[int]] = {}   # storage data_ptr -> [saved references alive, storage bytes]
        self.saved_bytes = 0
        self.peak_total = self.peak_saved = self.peak_kv = self.peak_stash = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _states(self) -> list:
        return list(getattr(self.engine, "_states", {}).values())

    def kv_bytes(self) -> int:
        return sum(state.nbytes() for state in self._states())

    def _kv_ptrs(self) -> set[int]:
        ptrs = set()
        for state in self._states():
            for bufs in state.kv.values():
                for t in (bufs.k, bufs.v, bufs.grad_k, bufs.grad_v):
                    if t is not None:
                        ptrs.add(t.untyped_storage().data_ptr())
        return ptrs

    def _pack(self, tensor: Any) -> Any:
        import weakref

        storage = tensor.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in self.param_ptrs or ptr in self._kv_ptrs():
            return tensor
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [1, nbytes]
            self.saved_bytes += nbytes
        else:
            entry[0] += 1
        box = _Saved(tensor)
        weakref.finalize(box, self._release, ptr)
        self.sample()
        return box

    @staticmethod
    def _unpack(packed: Any) -> Any:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.saved_bytes -= entry[1]
            del self.live[ptr]

    def stash_bytes(self) -> int:
        """Deferred weight gradients: the recorded (input, output-gradient) pairs that no saved tensor counts."""
        seen: set[int] = set()
        total = 0
        for stash in getattr(self.engine, "_stashes", {}).values():
            for t in stash.tensors():
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in seen and ptr not in self.live:
                    seen.add(ptr)
                    total += storage.nbytes()
        return total

    def sample(self) -> None:
        kv, stash = self.kv_bytes(), self.stash_bytes()
        self.peak_saved = max(self.peak_saved, self.saved_bytes)
        self.peak_kv = max(self.peak_kv, kv)
        self.peak_stash = max(self.peak_stash, stash)
        self.peak_total = max(self.peak_total, self.saved_bytes + kv + stash)

    def __enter__(self) -> "ActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class HeapMeter:
    """Peak bytes the stage's process allocates during one step, above what it held when the step began.

    :class:`ActivationMeter` counts what autograd keeps for backward; this counts everything a step allocates:
    saved activations, KV buffers and their gradients, backward temporaries, gradients, communication buffers,
    optimizer scratch. That is the peak a device must fit, and it treats stock DeepSpeed and the token pipeline
    alike (the unsliced backward's full-length temporaries count as much as the KV gradient buffers). CPU tensors
    are plain ``malloc``, so glibc's ``mallinfo2`` (live bytes of the main arena plus mmapped chunks; CPU backward
    runs on the calling thread, in the main arena) is read after every aten op through a ``TorchDispatchMode``
    and after every instruction. Scratch a kernel frees before it returns is not seen.
    """

    def __init__(self) -> None:
        import ctypes

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        class _MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in
                        ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                         "fordblks", "keepcost")]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        self._mallinfo = libc.mallinfo2
        meter = self

        class _SampleAfterOps(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: N805 (torch's signature)
                out = func(*args, **(kwargs or {}))
                meter.sample(func)
                return out

        self._mode = _SampleAfterOps()
        self.base = self.peak = 0
        self.instruction = ""   # set by InstructionRecorder before each instruction runs
        self.peak_at = ""       # "instruction / op" where the peak was reached
        with self._mode:   # the mode's first use allocates for good (~20 MB); not the step's to pay
            x = torch.ones(8, requires_grad=True)
            (x * 2).sum().backward()

    def in_use(self) -> int:
        info = self._mallinfo()
        return info.uordblks + info.hblkhd

    def sample(self, op: Any = None) -> None:
        now = self.in_use()
        if now > self.peak:
            self.peak = now
            self.peak_at = f"{self.instruction} / {op}"

    def __enter__(self) -> "HeapMeter":
        self.base = self.peak = self.in_use()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    @property
    def peak_bytes(self) -> int:
        return self.peak - self.base


class InstructionRecorder:
    """Wraps every handler of an engine's instruction map (on the instance) to time it.

    ``PipelineEngine._exec_schedule`` dispatches through ``self._INSTRUCTION_MAP`` (class-level functions bound
    with ``MethodType``), so patching ``engine._exec_forward_pass`` on the instance would never be called; an
    instance-level copy of the map is. Times are ``time.time()`` ms, the clock ranks on one host share.
    """

    def __init__(self, engine: Any, stage: int) -> None:
        self.stage = stage
        self.records: list[tuple[str, int, int, float, float]] = []   # (instruction, microbatch, slice, t0, t1)
        self.chunks: list[int] = []   # per record: the chunk it ran on (virtual stages), else the stage
        self.compute_cpu_ms = 0.0   # this thread's CPU time inside forward/backward (vs wall: descheduling)
        self.meter: ActivationMeter | HeapMeter | None = None
        self._counts: dict[str, int] = {}
        wrapped = {}
        for cls, handler in type(engine)._INSTRUCTION_MAP.items():
            wrapped[cls] = self._wrap(cls.__name__, handler)
        engine._INSTRUCTION_MAP = wrapped

    def _wrap(self, name: str, handler: Any) -> Any:
        recorder = self

        def timed(engine: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(recorder.meter, HeapMeter):
                recorder.meter.instruction = f"{name}{kwargs.get('microbatch', '')}.{kwargs.get('slice_index', '')}"
            c0 = time.thread_time()
            t0 = time.time() * 1e3
            out = handler(engine, *args, **kwargs)
            t1 = time.time() * 1e3
            if name in KINDS:
                recorder.compute_cpu_ms += (time.thread_time() - c0) * 1e3
            if "microbatch" in kwargs:
                mb, sl = kwargs["microbatch"], kwargs.get("slice_index", 0)   # TokenPipeSchedule's fields
            else:  # stock DeepSpeed: micro-batches run in order per instruction type
                mb, sl = recorder._counts.get(name, 0), 0
                recorder._counts[name] = mb + 1
            recorder.records.append((name, int(mb), int(sl), t0, t1))
            recorder.chunks.append(int(kwargs.get("chunk", recorder.stage)))
            if recorder.meter is not None:
                recorder.meter.sample()
            return out

        return timed

    def reset(self) -> None:
        self.records = []
        self.chunks = []
        self._counts = {}
        self.compute_cpu_ms = 0.0


class CpuMeter:
    """CPU used on this machine by processes other than the benchmark's workers (Linux /proc), in cores.

    Busy = user + nice + system + irq + softirq + steal jiffies of /proc/stat; ours = utime + stime of every
    worker (all threads). On a shared machine a foreign process steals a core from a token pipeline, whose two
    stages compute at the same time, far more than from stock 1F1B at m=1, where one stage mostly waits: the
    noise is not symmetric, so rounds with foreign load are flagged (and excluded from the table).
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.tick = os.sysconf("SC_CLK_TCK")
        self._last = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
            busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
            ours = 0
            for pid in self.pids:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ours += int(fields[11]) + int(fields[12])
            return busy / self.tick, ours / self.tick, time.monotonic()
        except (OSError, ValueError, IndexError):
            return None

    def foreign_cores(self) -> float:
        """Foreign cores used since the previous call (NaN where /proc is not readable)."""
        now, last = self._read(), self._last
        self._last = now
        if now is None or last is None or now[2] <= last[2]:
            return float("nan")
        return max(0.0, ((now[0] - last[0]) - (now[1] - last[1])) / (now[2] - last[2]))

    def wait_quiet(self, max_s: float, below: float = 0.1, window_s: float = 1.0) -> float:
        """Block until foreign load stays below ``below`` cores for ``window_s`` (at most ``max_s``); seconds waited."""
        start = time.monotonic()
        self.foreign_cores()
        while time.monotonic() - start < max_s:
            time.sleep(window_s)
            if self.foreign_cores() < below:
                break
        return time.monotonic() - start


def step_summary(records: list[tuple[str, int, int, float, float]], t_start: float, t_end: float,
                 compute_cpu_ms: float = float("nan")) -> dict:
    """Per-rank breakdown of one step, in ms."""
    total: dict[str, float] = {}
    for name, _, _, t0, t1 in records:
        total[name] = total.get(name, 0.0) + (t1 - t0)
    compute = [(t0, t1) for name, _, _, t0, t1 in records if name in KINDS]
    fwd, bwd, wgt = total.get("ForwardPass", 0.0), total.get("BackwardPass", 0.0), total.get("WeightGradPass", 0.0)
    recv = total.get("RecvActivation", 0.0) + total.get("RecvGrad", 0.0)
    send = total.get("SendActivation", 0.0) + total.get("SendGrad", 0.0)
    tail = sum(total.get(k, 0.0) for k in ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep", "CommitP2P"))
    instr = sum(total.values())
    return {"step_ms": t_end - t_start, "forward_ms": fwd, "backward_ms": bwd, "weight_ms": wgt,
            "busy_ms": fwd + bwd + wgt,
            "recv_ms": recv, "send_ms": send, "tail_ms": tail, "load_ms": total.get("LoadMicroBatch", 0.0),
            "outside_ms": (t_end - t_start) - instr,
            "compute_start_ms": min(t0 for t0, _ in compute) - t_start if compute else 0.0,
            "compute_end_ms": max(t1 for _, t1 in compute) - t_start if compute else 0.0,
            "num_forward": sum(1 for r in records if r[0] == "ForwardPass"),
            "cpu_share": compute_cpu_ms / (fwd + bwd + wgt) if fwd + bwd + wgt > 0 else float("nan")}


def compute_events(records: list, stage: int, t_start: float, chunks: list[int] | None = None) -> list[list]:
    """Compute records as [stage, "F"|"B"|"W", microbatch, slice, start_ms, end_ms, chunk] relative to t_start.

    ``chunks`` (one per record, :attr:`InstructionRecorder.chunks`) names the chunk each ran on when a rank
    holds several; without it the chunk is the stage.
    """
    chunks = chunks if chunks is not None else [stage] * len(records)
    return [[stage, KINDS[n], mb, sl, t0 - t_start, t1 - t_start, c]
            for (n, mb, sl, t0, t1), c in zip(records, chunks) if n in KINDS]
