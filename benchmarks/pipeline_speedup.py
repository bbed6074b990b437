"""Token pipeline vs stock DeepSpeed pipeline on CPU: step time, bubble-free bound, planner error, activation memory.

    python benchmarks/pipeline_speedup.py --quick                       # 1-2 minute smoke run
    python benchmarks/pipeline_speedup.py                               # the full table (~15 min, 2 cores)
    python benchmarks/pipeline_speedup.py --plots docs                  # + timelines

Two stages, one process per stage with ONE thread each (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``),
gloo, the reference GPT (``ds_terapipe.models.gpt``, blocks split evenly over the stages), micro-batch size 1.
For every m (gradient_accumulation_steps) the worker builds each variant's engine once:

* ``stock``:      ``deepspeed.initialize`` with the same ``TokenPipelineModule`` (DeepSpeed's ``TrainSchedule``, 1F1B);
* ``slices=1``:   ``ds_terapipe.initialize`` with ``"slices": 1`` (token 1f1b over whole sequences: must equal stock);
* ``auto/gpipe``, ``auto/1f1b``: ``"slices": "auto"`` (profiled at init, planned on rank 0, broadcast);

then runs ``--warmup`` + ``--steps`` rounds, each round one ``train_batch`` of every variant (order rotated per
round), so slow phases of a noisy machine hit every variant alike. Per step and rank the worker records every
pipeline instruction's start/end (the engine's instruction map is wrapped on the instance, the same span that
``engine.record_timeline`` times), so each step yields: step time (barrier to end of ``train_batch``, max over
ranks), each stage's busy time (sum of its forward + backward instructions), the pipeline span and the time in
receives, sends and the optimizer tail. Reported per row (medians over the measured rounds):

* ``step ms``: median step time; ``speedup``: median over rounds of stock step / variant step (paired);
* ``bound ms``: the bubble-free bound, the slowest stage's busy time; ``eff``: bound / step;
* ``pred ms``, ``err``: the planner's ``slicing_plan.predicted_ms`` and (pred - measured) / measured;
* ``re-prof ms``, ``re-prof err``: the same plan predicted again from costs profiled right after the timed rounds
  (``ds_terapipe.runtime.profile.measure_costs``, the engine's own profiler): on this shared host the same work
  runs 10-20% slower or faster minutes apart, so ``pred err`` mixes the host's drift since init with the cost
  model's and simulator's error, and ``re-prof err`` is mostly the latter;
* ``peak MiB``: everything one more untimed step allocates above what the process held when it began (parameter
  gradients, backward temporaries, communication buffers included), from glibc's ``mallinfo2`` after every aten op
  (:class:`HeapMeter`); the peak a stage's device must fit;
* activation memory per stage, from one extra (untimed) step under ``torch.autograd.graph.saved_tensors_hooks``:
  peak bytes of storages saved for backward and still alive (deduplicated by storage, parameters excluded; a
  ``weakref.finalize`` on the packed handle drops a storage when autograd frees its last saved reference) plus
  the KV cache buffers (``engine._states[*].nbytes()``, sampled at every pack and after every instruction).

The parent launches the workers (free port, RANK/WORLD_SIZE/MASTER_PORT env vars, like ``tests/dist_harness.py``),
prints the tables and the targets, writes the report (``--json``, default
``benchmarks/results/pipeline_speedup.json``), and with ``--plots DIR`` the measured timeline of the median step of
``--timeline`` (merged Chrome trace + PNG) beside the planner's simulated timeline of the same plan.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ds_terapipe.runtime.shm import remove_shm_segments

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "pipeline_speedup.json"   # the committed run's report
NUM_STAGES = 2

#: variant name -> terapipe section (None: stock DeepSpeed); the first variant is the baseline.
VARIANTS: dict[str, dict | None] = {
    "stock": None,
    "slices=1": {"slices": 1, "schedule": "1f1b"},
    "auto/gpipe": {"slices": "auto", "schedule": "gpipe"},   # defaults: deferred weight gradients (a W per
    "auto/1f1b": {"slices": "auto", "schedule": "1f1b"},     # micro-batch) with gpipe, none with 1f1b
}
#: more variants for --variants (not run by default)
OPTIONAL_VARIANTS: dict[str, dict] = {
    "auto/gpipe-noW": {"slices": "auto", "schedule": "gpipe", "deferred_weight_grads": False},
    "auto/1f1b+W": {"slices": "auto", "schedule": "1f1b", "deferred_weight_grads": True},   # a W per slice
    "slices=1+W": {"slices": 1, "schedule": "1f1b", "deferred_weight_grads": True},
}
KNOWN_VARIANTS = {**VARIANTS, **OPTIONAL_VARIANTS}


# ================================================================================================================
# Worker (one per stage)
# ================================================================================================================
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
                recorder.meter.instruction = f"{name}{kwargs.get('microbatch', '')}.{kwargs.get('slice', '')}"
            c0 = time.thread_time()
            t0 = time.time() * 1e3
            out = handler(engine, *args, **kwargs)
            t1 = time.time() * 1e3
            if name in _KINDS:
                recorder.compute_cpu_ms += (time.thread_time() - c0) * 1e3
            if "microbatch" in kwargs:
                mb, sl = kwargs["microbatch"], kwargs.get("slice", 0)
            else:  # stock DeepSpeed: micro-batches run in order per instruction type
                mb, sl = recorder._counts.get(name, 0), 0
                recorder._counts[name] = mb + 1
            recorder.records.append((name, int(mb), int(sl), t0, t1))
            if recorder.meter is not None:
                recorder.meter.sample()
            return out

        return timed

    def reset(self) -> None:
        self.records = []
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


def _step_summary(records: list[tuple[str, int, int, float, float]], t_start: float, t_end: float,
                  compute_cpu_ms: float = float("nan")) -> dict:
    """Per-rank breakdown of one step, in ms."""
    total: dict[str, float] = {}
    for name, _, _, t0, t1 in records:
        total[name] = total.get(name, 0.0) + (t1 - t0)
    compute = [(t0, t1) for name, _, _, t0, t1 in records if name in _KINDS]
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


#: compute instructions and their schedule-IR kind (W: deferred weight gradients of a micro-batch)
_KINDS = {"ForwardPass": "F", "BackwardPass": "B", "WeightGradPass": "W"}


def _compute_events(records: list, stage: int, t_start: float) -> list[list]:
    """Compute records as [stage, "F"|"B"|"W", microbatch, slice, start_ms, end_ms] relative to t_start."""
    return [[stage, _KINDS[n], mb, sl, t0 - t_start, t1 - t_start] for n, mb, sl, t0, t1 in records if n in _KINDS]


def _build_engine(variant: str, m: int, cfg: Any, opts: dict, out_dir: Path) -> tuple[Any, float]:
    """One engine of ``variant`` for m micro-batches of 1 sequence; returns it and its build seconds."""
    import deepspeed
    import torch

    import ds_terapipe
    from ds_terapipe.models.gpt import causal_lm_loss, gpt_layer_specs

    model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=NUM_STAGES, loss_fn=causal_lm_loss,
                                            vocab_size=cfg.vocab_size, partition_method="type:GPTBlock")
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m,
                              "train_batch_size": m, "steps_per_print": 10**9, "gradient_clipping": 0.0,
                              "zero_optimization": {"stage": 0}}
    section = {**KNOWN_VARIANTS, **opts.get("extra_variants", {})}[variant]
    if section is not None:
        config["terapipe"] = {"p2p_timeout_s": 900.0, **section, "enabled": True, "seq_len": opts["seq_len"],
                              "plan_cache": str(_plan_dir(out_dir, m, variant))}
        if opts.get("profile") and section.get("slices", "auto") == "auto":
            config["terapipe"]["profile"] = opts["profile"]
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    init = ds_terapipe.initialize if section is not None else deepspeed.initialize
    t0 = time.perf_counter()
    engine, _, _, _ = init(model=model, optimizer=opt, config=config)
    return engine, time.perf_counter() - t0


def _plan_dir(out_dir: Path, m: int, variant: str) -> Path:
    return out_dir / "plans" / f"m{m}-{variant.replace('/', '-')}"


def _engine_info(engine: Any, variant: str, m: int, seq_len: int, build_s: float, build_foreign: float,
                 out_dir: Path) -> dict:
    plan = getattr(engine, "slicing_plan", None)
    tp = getattr(engine, "terapipe", None)
    info = {"build_s": build_s, "build_foreign_cores": build_foreign, "stage": engine.stage_id,
            "schedule": tp.schedule if tp is not None else "deepspeed-1f1b",
            "slices": list(getattr(engine, "slices", [seq_len])),
            "plan": plan.to_dict() if plan is not None else None,
            "plan_source": getattr(engine, "plan_source", None),
            "deferred_weight_grads": bool(getattr(tp, "deferred_weight_grads", False)),
            "layers": [type(f).__name__ for f in engine.module.forward_funcs], "steps": [], "losses": []}
    files = sorted(_plan_dir(out_dir, m, variant).glob("terapipe-plan-*.json")) if plan is not None else []
    if files:  # the profiled cost model (written by rank 0), for the simulated timeline and the per-slice check
        info["cost"] = json.loads(files[0].read_text()).get("cost")
    return info


def _timed_step(engine: Any, rec: InstructionRecorder, batches: list, cpu: CpuMeter | None) -> tuple[dict, float]:
    """One ``train_batch`` after a barrier; its per-rank summary and loss."""
    import torch.distributed as dist

    rec.reset()
    dist.barrier()
    if cpu is not None:
        cpu.foreign_cores()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t_start = time.time() * 1e3
    loss = engine.train_batch(iter(batches))
    t_end = time.time() * 1e3
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    summary = _step_summary(rec.records, t_start, t_end, rec.compute_cpu_ms)
    summary["foreign_cores"] = cpu.foreign_cores() if cpu is not None else float("nan")
    # this process (all threads): user/system CPU, minor page faults, involuntary/voluntary context switches
    summary.update(user_ms=(ru1.ru_utime - ru0.ru_utime) * 1e3, sys_ms=(ru1.ru_stime - ru0.ru_stime) * 1e3,
                   minflt=ru1.ru_minflt - ru0.ru_minflt, nivcsw=ru1.ru_nivcsw - ru0.ru_nivcsw,
                   nvcsw=ru1.ru_nvcsw - ru0.ru_nvcsw)
    summary["events"] = _compute_events(rec.records, engine.stage_id, t_start)
    return summary, float(loss)


def _run_rounds(engines: dict, recorders: dict, info: dict, batches: list, m: int, opts: dict,
                cpu: CpuMeter | None, rank: int) -> list[dict]:
    """Warm-up rounds, then timed rounds until ``steps`` clean ones (or ``max_rounds``); one step per variant each."""
    import torch.distributed as dist

    names = list(engines)
    rounds: list[dict] = []
    rnd = clean = 0
    while True:
        warm = rnd < opts["warmup"]
        waited = cpu.wait_quiet(opts["quiet_wait"]) if cpu is not None and not warm else 0.0
        foreign: dict[str, float] = {}
        for variant in names[rnd % len(names):] + names[:rnd % len(names)]:   # rotated order
            summary, loss = _timed_step(engines[variant], recorders[variant], batches, cpu)
            foreign[variant] = summary["foreign_cores"]
            if not warm:
                summary["round"] = rnd - opts["warmup"]
                info[variant]["steps"].append(summary)
                info[variant]["losses"].append(loss)
        rnd += 1
        if warm:
            continue
        # rank 0 measures the machine: it decides whether the round was clean and whether to go on
        is_clean = cpu is None or max(foreign.values()) < opts["foreign_max"]
        clean += int(is_clean)
        done = clean >= opts["steps"] or rnd - opts["warmup"] >= opts["max_rounds"]
        decision = [(is_clean, done, waited, foreign)]
        dist.broadcast_object_list(decision, src=0)
        is_clean, done, waited, foreign = decision[0]
        rounds.append({"round": rnd - 1 - opts["warmup"], "clean": is_clean, "waited_s": waited,
                       "foreign_cores": foreign})
        if rank == 0:
            line = " ".join(f"{v}={info[v]['steps'][-1]['step_ms']:.0f}ms" for v in names)
            load = " ".join(f"{foreign[v]:.2f}" for v in names)
            print(f"[rank 0] m={m} round {rnd - 1 - opts['warmup']} {'clean' if is_clean else 'NOISY'} "
                  f"(waited {waited:.0f}s; foreign cores {load}) {line}", flush=True)
        if done:
            return rounds


def _reprofile(engine: Any) -> dict | None:
    """Profile the stages again right after the timed rounds and predict the same plan from those costs.

    The plan's ``predicted_ms`` comes from costs measured at init, minutes before the rounds; on this shared host
    the same work runs up to 20% slower (or faster) minutes later, so its error mixes the model's with the
    host's. Costs measured next to the rounds, fed to the same schedule and simulator, leave the model's.
    """
    from ds_terapipe.planner.schedule import build_schedule
    from ds_terapipe.planner.simulate import simulate
    from ds_terapipe.runtime.profile import measure_costs

    measured = measure_costs(engine)
    if measured is None:   # not global rank 0
        return None
    cost, _, seconds = measured
    tp = engine.terapipe
    plan = build_schedule(tp.schedule, engine.num_stages, engine.micro_batches, len(engine.slices),
                          tp.deferred_weight_grads)
    sim = simulate(plan, cost, list(engine.slices), micro_batch_size=engine.micro_batch_size)
    return {"predicted_ms": float(sim.makespan_ms), "profile_s": seconds, "cost": cost.to_dict()}


def _measure_memory(engine: Any, rec: InstructionRecorder, batches: list) -> dict:
    """Two untimed steps: peak activation bytes of this stage (saved-tensor hooks), then its peak heap bytes."""
    import torch.distributed as dist

    rec.reset()
    meter = ActivationMeter(engine)
    rec.meter = meter
    dist.barrier()
    with meter:
        engine.train_batch(iter(batches))
    result = {"peak_total_bytes": meter.peak_total, "peak_saved_bytes": meter.peak_saved,
              "peak_kv_bytes": meter.peak_kv, "peak_stash_bytes": meter.peak_stash,
              "left_alive_bytes": meter.saved_bytes}
    del meter
    gc.collect()
    heap = HeapMeter()
    rec.meter = heap
    dist.barrier()
    with heap:
        engine.train_batch(iter(batches))
    rec.meter = None
    result["peak_heap_bytes"] = heap.peak_bytes
    result["peak_heap_at"] = heap.peak_at
    return result


def worker_main(out_dir: Path, opts: dict) -> None:
    """One stage: build every variant's engine per m, alternate their steps, measure memory, write rank{R}.json."""
    rank = int(os.environ["RANK"])
    if opts.get("bind_cores"):  # like the deepspeed launcher's --bind_cores_to_rank: one core per stage
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    import deepspeed
    import torch.distributed as dist

    from ds_terapipe.models.gpt import GPTConfig

    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    assert world == NUM_STAGES, f"this benchmark runs {NUM_STAGES} stages, got world size {world}"
    seq_len = opts["seq_len"]
    cfg = GPTConfig(num_layers=opts["layers"], hidden=opts["hidden"], num_heads=opts["heads"],
                    vocab_size=opts["vocab"], max_seq_len=seq_len, seed=1234)
    gen = torch.Generator().manual_seed(7)
    max_m = max(opts["micro_batches"])
    ids = torch.randint(0, cfg.vocab_size, (max_m, 1, seq_len + 1), generator=gen)   # (m, B=1, L+1)
    batches = [(ids[i, :, :-1].contiguous(), ids[i, :, 1:].contiguous()) for i in range(max_m)]
    result: dict[str, Any] = {"rank": rank, "threads": torch.get_num_threads(), "torch": torch.__version__,
                              "deepspeed": deepspeed.__version__, "per_m": {}}
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    cpu = CpuMeter(pids) if rank == 0 and os.path.exists("/proc/stat") else None
    for m in opts["micro_batches"]:
        engines, recorders, info = {}, {}, {}
        for variant in opts["variants"]:
            # profiling at init (slices "auto") should see a quiet machine too
            if cpu is not None:
                cpu.wait_quiet(opts["quiet_wait"])
            dist.barrier()
            if cpu is not None:
                cpu.foreign_cores()
            engine, build_s = _build_engine(variant, m, cfg, opts, out_dir)
            build_foreign = cpu.foreign_cores() if cpu is not None else float("nan")
            engines[variant] = engine
            recorders[variant] = InstructionRecorder(engine, engine.stage_id)
            info[variant] = _engine_info(engine, variant, m, seq_len, build_s, build_foreign, out_dir)
            print(f"[rank {rank}] m={m} {variant}: built in {build_s:.1f}s (foreign cores {build_foreign:.2f}), "
                  f"slices {info[variant]['slices']}", flush=True)
        rounds = _run_rounds(engines, recorders, info, batches[:m], m, opts, cpu, rank)
        for variant in engines:
            info[variant]["rounds"] = rounds
            if info[variant]["plan_source"] == "profiled":
                info[variant]["reprofiled"] = _reprofile(engines[variant])
            info[variant]["memory"] = _measure_memory(engines[variant], recorders[variant], batches[:m])
        result["per_m"][str(m)] = info
        engines.clear()
        recorders.clear()
        gc.collect()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


# ================================================================================================================
# Parent
# ================================================================================================================
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(out_dir: Path, opts: dict, timeout_s: float) -> list[dict]:
    """Run the two workers; return each rank's result (raises with the log tails if one fails or hangs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out_dir / "plans", ignore_errors=True)  # profile afresh: a cached plan would skip profiling
    port = _free_port()
    procs, logs = [], []
    for rank in range(NUM_STAGES):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(NUM_STAGES),
                   LOCAL_WORLD_SIZE=str(NUM_STAGES), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        log = open(out_dir / f"rank{rank}.log", "w")
        logs.append(log)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out_dir), json.dumps(opts)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    deadline = time.monotonic() + timeout_s
    shown = 0
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                time.sleep(3)
                break
            lines = (out_dir / "rank0.log").read_text(errors="replace").splitlines()
            for line in lines[shown:]:
                if line.startswith("[rank 0]"):
                    print(line, flush=True)
            shown = len(lines)
            time.sleep(1.0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
        remove_shm_segments(port)  # DeepSpeed's CPU allreduce never unlinks its 66 MB segments
    codes = [p.returncode for p in procs]
    if any(codes):
        tails = "\n".join(f"--- rank {r} (exit {codes[r]}):\n" + "\n".join(
            (out_dir / f"rank{r}.log").read_text(errors="replace").splitlines()[-30:]) for r in range(NUM_STAGES))
        raise SystemExit(f"benchmark workers failed or timed out after {timeout_s:.0f}s (logs in {out_dir})\n{tails}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(NUM_STAGES)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def analyse(ranks: list[dict], opts: dict) -> dict:
    """Combine the ranks' records into rows: per (m, variant) medians, ratios, bound, planner error, memory.

    Statistics use the clean rounds (no foreign load during any step of the round) when there are at least
    ``min(3, steps)`` of them, else every round (the row says which).
    """
    rows = []
    first = str(opts["micro_batches"][0])
    by_stage = sorted(ranks, key=lambda r: r["per_m"][first][opts["variants"][0]]["stage"])
    base = opts["variants"][0]
    keys = ("step_ms", "forward_ms", "backward_ms", "weight_ms", "busy_ms", "recv_ms", "send_ms", "tail_ms", "load_ms",
            "outside_ms", "compute_start_ms", "compute_end_ms", "cpu_share", "user_ms", "sys_ms", "minflt", "nivcsw",
            "nvcsw")
    for m in opts["micro_batches"]:
        infos = [r["per_m"][str(m)] for r in by_stage]   # index = stage
        rounds = infos[0][base]["rounds"]
        clean = {r["round"] for r in rounds if r["clean"]}
        use = clean if len(clean) >= min(3, opts["steps"]) else {r["round"] for r in rounds}
        # per variant: list over used rounds of per-stage step summaries
        steps = {v: [per_stage for per_stage in zip(*(info[v]["steps"] for info in infos))
                     if per_stage[0]["round"] in use] for v in opts["variants"]}
        step_ms = {v: {ps[0]["round"]: max(s["step_ms"] for s in ps) for ps in steps[v]} for v in opts["variants"]}
        for v in opts["variants"]:
            per_round = steps[v]
            times = [step_ms[v][ps[0]["round"]] for ps in per_round]
            bound = [max(s["busy_ms"] for s in ps) for ps in per_round]
            span = [max(s["compute_end_ms"] for s in ps) - min(s["compute_start_ms"] for s in ps) for ps in per_round]
            eff = [b / t for b, t in zip(bound, times)]
            ratios = [step_ms[base][r] / t for r, t in step_ms[v].items() if r in step_ms[base]]
            plan = infos[0][v]["plan"]
            med = _median(times)
            again = infos[0][v].get("reprofiled")
            med_i = min(range(len(times)), key=lambda i: abs(times[i] - med))
            stage_rows = []
            for stage, info in enumerate(infos):
                ss = [ps[stage] for ps in per_round]
                stage_rows.append({k: _median([x[k] for x in ss]) for k in keys})
                stage_rows[-1].update(memory=info[v]["memory"], build_s=info[v]["build_s"])
            row = {
                "m": m, "variant": v, "slices": infos[0][v]["slices"], "num_slices": len(infos[0][v]["slices"]),
                "rounds_used": sorted(use), "clean_rounds": len(clean), "all_rounds": len(rounds),
                "step_ms": med, "step_ms_all": times, "step_ms_min": min(times), "step_ms_max": max(times),
                "speedup": _median(ratios), "speedup_ratios": ratios, "speedup_of_medians": _median(
                    [step_ms[base][ps[0]["round"]] for ps in steps[base]]) / med,
                "bound_ms": _median(bound), "efficiency": _median(eff), "span_ms": _median(span),
                "predicted_ms": plan["predicted_ms"] if plan else None,
                "planner_unsliced_ms": plan["unsliced_ms"] if plan else None,
                "pred_err": (plan["predicted_ms"] - med) / med if plan else None,
                "pred_err_vs_span": (plan["predicted_ms"] - _median(span)) / _median(span) if plan else None,
                "reprofiled_ms": again["predicted_ms"] if again else None,
                "reprofiled_err": (again["predicted_ms"] - med) / med if again else None,
                "reprofiled_cost": again["cost"] if again else None,
                "plan_source": infos[0][v]["plan_source"], "schedule": infos[0][v]["schedule"],
                "deferred_weight_grads": infos[0][v].get("deferred_weight_grads", False),
                "stages": stage_rows,
                "foreign_cores": _median([max(s["foreign_cores"] for s in ps) for ps in per_round]),
                "losses": infos[-1][v]["losses"],
                "median_step_events": [e for ev in (ps["events"] for ps in per_round[med_i]) for e in ev],
                "median_step_ms": times[med_i],
                "cost": next((info[v].get("cost") for info in infos if info[v].get("cost")), None),
            }
            row["activation_mib"] = [s["memory"]["peak_total_bytes"] / 2**20 for s in stage_rows]
            row["heap_mib"] = [s["memory"]["peak_heap_bytes"] / 2**20 for s in stage_rows]
            rows.append(row)
    return {"rows": rows}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_tables(report: dict, opts: dict) -> str:
    rows = report["rows"]
    out = []
    out.append("| m | variant | slices | step ms | speedup | bound ms | eff | pred ms | pred err | re-prof ms | re-prof err "
               "| act MiB s0/s1 | peak MiB s0/s1 | rounds |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        n = r["num_slices"]
        sl = str(n) if n > 1 else "1"
        act = "/".join(f"{a:.0f}" for a in r["activation_mib"])
        heap = "/".join(f"{a:.0f}" for a in r["heap_mib"])
        err = "-" if r["pred_err"] is None else f"{100 * r['pred_err']:+.1f}%"
        err_r = "-" if r["reprofiled_err"] is None else f"{100 * r['reprofiled_err']:+.1f}%"
        out.append(f"| {r['m']} | {r['variant']} | {sl} | {r['step_ms']:.0f} | {r['speedup']:.2f}x | "
                   f"{r['bound_ms']:.0f} | {100 * r['efficiency']:.0f}% | {_fmt(r['predicted_ms'], '.0f')} | "
                   f"{err} | {_fmt(r['reprofiled_ms'], '.0f')} | {err_r} | {act} | {heap} | {len(r['rounds_used'])}{'' if r['clean_rounds'] >= len(r['rounds_used']) else '*'} |")
    out.append("")
    out.append("pred: the plan's prediction from costs profiled at init; re-prof: the same plan predicted from costs "
               "profiled again right after the rounds. act: saved for backward + KV buffers; peak: everything the "
               "step allocates (grads, temporaries) above the step's start")
    out.append("rounds: timed rounds in the medians; * = too few clean rounds, noisy rounds included")
    out.append("")
    out.append("Per stage (medians, ms): forward / backward / deferred weight gradients / waiting in recv / send / "
               "grads+optimizer tail / outside instructions; cpu = thread CPU time / wall time inside compute")
    out.append("| m | variant | stage 0 F/B/W/recv/send/tail/out | stage 1 F/B/W/recv/send/tail/out | cpu s0/s1 | "
               "planned slices |")
    out.append("|---|---|---|---|---|---|")
    for r in rows:
        cells = ["/".join(f"{s[k]:.0f}" for k in ("forward_ms", "backward_ms", "weight_ms", "recv_ms", "send_ms", "tail_ms",
                                                   "outside_ms")) for s in r["stages"]]
        sl = r["slices"] if r["num_slices"] <= 12 else f"{r['slices'][:12]}..."
        cpu = "/".join(f"{s['cpu_share']:.2f}" for s in r["stages"])
        out.append(f"| {r['m']} | {r['variant']} | {cells[0]} | {cells[1]} | {cpu} | "
                   f"{sl if r['num_slices'] > 1 else '-'} |")
    text = "\n".join(out)
    print(text)
    return text


def check_targets(report: dict) -> list[dict]:
    rows = report["rows"]
    checks = []
    for r in rows:
        if r["variant"].startswith("auto"):
            if r["m"] == 1:
                checks.append({"target": f"m=1 {r['variant']} speedup >= 1.6x", "value": r["speedup"],
                               "met": r["speedup"] >= 1.6})
            checks.append({"target": f"m={r['m']} {r['variant']} efficiency >= 85%", "value": r["efficiency"],
                           "met": r["efficiency"] >= 0.85})
            checks.append({"target": f"m={r['m']} {r['variant']} |prediction error| <= 10%", "value": r["pred_err"],
                           "met": abs(r["pred_err"]) <= 0.10})
            if r["reprofiled_err"] is not None:
                checks.append({"target": f"m={r['m']} {r['variant']} |prediction error| <= 10%, costs re-profiled "
                               "after the rounds", "value": r["reprofiled_err"], "met": abs(r["reprofiled_err"]) <= 0.10})
        if r["variant"] == "slices=1":
            checks.append({"target": f"m={r['m']} slices=1 within 3% of stock", "value": r["speedup"],
                           "met": abs(1.0 / r["speedup"] - 1.0) <= 0.03})
        stock = next((x for x in rows if x["m"] == r["m"] and x["variant"] == "stock"), None)
        if r["variant"] == "auto/1f1b" and stock is not None:
            worst = max(a / s for a, s in zip(r["activation_mib"], stock["activation_mib"]))
            checks.append({"target": f"m={r['m']} auto/1f1b activations <= stock, every stage (worst ratio)",
                           "value": worst, "met": worst <= 1.0})
            peak = max(r["activation_mib"]) / max(stock["activation_mib"])
            checks.append({"target": f"m={r['m']} auto/1f1b activations <= stock, busiest stage (ratio)",
                           "value": peak, "met": peak <= 1.0})
            worst = max(a / s for a, s in zip(r["heap_mib"], stock["heap_mib"]))
            checks.append({"target": f"m={r['m']} auto/1f1b peak step memory <= stock, every stage (worst ratio)",
                           "value": worst, "met": worst <= 1.0})
    for c in checks:
        print(f"  [{'met ' if c['met'] else 'MISS'}] {c['target']}: {c['value']:.3f}")
    return checks


def write_plots(report: dict, which: tuple[int, str], out_dir: Path, work_dir: Path) -> dict:
    """Measured timeline of the median step (per-rank traces merged) and the planner's simulated one."""
    from ds_terapipe.planner.cost import PipelineCost
    from ds_terapipe.planner.schedule import Action, ActionKind, build_schedule
    from ds_terapipe.planner.simulate import TimedAction, simulate
    from ds_terapipe.trace import events_to_chrome_trace, load_chrome_trace, merge_traces, plot_timeline

    m, variant = which
    row = next(r for r in report["rows"] if r["m"] == m and r["variant"] == variant)
    kinds = {"F": ActionKind.FORWARD, "B": ActionKind.BACKWARD, "W": ActionKind.WEIGHT}
    per_rank = []
    for stage in range(NUM_STAGES):
        evs = [TimedAction(s, Action(s, kinds[k], mb, sl), t0, t1) for s, k, mb, sl, t0, t1 in
               row["median_step_events"] if s == stage]
        path = work_dir / f"measured-m{m}-{variant.replace('/', '-')}-rank{stage}.json"
        events_to_chrome_trace(evs, path, metadata={"stage": stage, "m": m, "variant": variant,
                                                    "slices": row["slices"]})
        per_rank.append(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"m{m}-{variant.replace('/', '-')}"
    merged = merge_traces(per_rank, out_dir / f"timeline-measured-{tag}.json")
    measured = load_chrome_trace(merged)
    span = max(e.end_ms for e in measured) - min(e.start_ms for e in measured)
    step = row["median_step_ms"]
    plot_timeline(measured, out_dir / f"timeline-measured-{tag}.png",
                  title=f"measured: {variant}, m={m}, {row['num_slices']} slices; compute span {span:.0f} ms "
                        f"(step {step:.0f} ms incl. optimizer)")
    paths = {"measured_trace": str(merged), "measured_png": str(out_dir / f"timeline-measured-{tag}.png")}
    if row["cost"] is not None:
        cost = PipelineCost.from_dict(row["cost"], num_stages=NUM_STAGES)
        sched = build_schedule(row["schedule"], NUM_STAGES, m, row["num_slices"], row.get("deferred_weight_grads", False))
        sim = simulate(sched, cost, row["slices"], micro_batch_size=1)
        events_to_chrome_trace(sim.events, out_dir / f"timeline-planned-{tag}.json",
                               metadata={"m": m, "variant": variant, "slices": row["slices"],
                                         "makespan_ms": sim.makespan_ms})
        plot_timeline(sim.events, out_dir / f"timeline-planned-{tag}.png",
                      title=f"planned: {variant}, m={m}, {row['num_slices']} slices; simulated makespan "
                            f"{sim.makespan_ms:.0f} ms")
        paths.update(planned_trace=str(out_dir / f"timeline-planned-{tag}.json"),
                     planned_png=str(out_dir / f"timeline-planned-{tag}.png"))
        # per-slice check of the cost model against the measured actions of the median step
        per_action = []
        lens = row["slices"]
        ctx = [sum(lens[:i]) for i in range(len(lens))]
        for s, k, mb, sl, t0, t1 in row["median_step_events"]:
            model = cost.stage(s)
            w_tokens = lens[sl] if sched.weights_per_slice else sum(lens)
            pred = float(model.weight_ms(w_tokens, 1)) if k == "W" else \
                float((model.forward_ms if k == "F" else model.backward_ms)(lens[sl], ctx[sl], 1))
            per_action.append({"stage": s, "kind": k, "microbatch": mb, "slice": sl, "measured_ms": t1 - t0,
                               "predicted_ms": pred})
        paths["per_action"] = per_action
    return paths


def cost_model_check(report: dict) -> list[dict]:
    """For every auto row: the cost model's F/B/W per slice vs the measured medians over all rounds (per stage)."""
    from ds_terapipe.planner.cost import PipelineCost
    from ds_terapipe.planner.schedule import WEIGHTS_PER_SLICE

    out = []
    for r in report["rows"]:
        if r["cost"] is None:
            continue
        cost = PipelineCost.from_dict(r["cost"], num_stages=NUM_STAGES)
        lens = r["slices"]
        ctx = [sum(lens[:i]) for i in range(len(lens))]
        for stage in range(NUM_STAGES):
            for kind in ("F", "B", "W"):
                model = cost.stage(stage)
                if kind == "W":
                    if not r.get("deferred_weight_grads"):
                        continue
                    # linear in tokens: the same total whether W runs per micro-batch or per slice
                    pred = float(model.weight_ms(sum(lens), 1)) * r["m"]
                    actions = r["m"] * (len(lens) if WEIGHTS_PER_SLICE.get(r["schedule"]) else 1)
                else:
                    fn = model.forward_ms if kind == "F" else model.backward_ms
                    pred = sum(float(fn(lens[i], ctx[i], 1)) for i in range(len(lens))) * r["m"]
                    actions = len(lens) * r["m"]
                meas = r["stages"][stage][{"F": "forward_ms", "B": "backward_ms", "W": "weight_ms"}[kind]]
                out.append({"m": r["m"], "variant": r["variant"], "stage": stage, "kind": kind,
                            "predicted_ms": pred, "measured_ms": meas, "err": (pred - meas) / meas,
                            "per_action_overhead_ms": (meas - pred) / actions})
    return out


def _git_describe() -> str | None:
    """The commit measured, with "+dirty" when tracked files under ds_terapipe/ differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "ds_terapipe"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(Path(sys.argv[2]), json.loads(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8, help="transformer blocks (split evenly over 2 stages)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--micro-batches", type=str, default="1,2,4", help="m values, comma-separated")
    ap.add_argument("--variants", type=str, default=",".join(VARIANTS),
                    help=f"comma-separated, from {', '.join(KNOWN_VARIANTS)} (first: baseline)")
    ap.add_argument("--extra-variant", action="append", default=[], metavar="NAME=JSON",
                    help='another token-pipeline variant: its "terapipe" section, e.g. '
                         '\'fixed8={"slices": 8, "schedule": "gpipe"}\' (repeatable; appended to --variants)')
    ap.add_argument("--profile", metavar="JSON", help='"terapipe.profile" for the auto variants, e.g. '
                    '\'{"repeats": 5}\' (default: the engine\'s defaults)')
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds per m")
    ap.add_argument("--steps", type=int, default=7, help="timed rounds per m (one step of every variant each)")
    ap.add_argument("--max-rounds", type=int, help="timed rounds at most, clean or not (default 2 x --steps)")
    ap.add_argument("--quiet-wait", type=float, default=20.0,
                    help="seconds to wait before each timed round for other processes to go quiet (0: never)")
    ap.add_argument("--foreign-max", type=float, default=0.2,
                    help="a round is clean when other processes used fewer cores than this during each step")
    ap.add_argument("--quick", action="store_true", help="small model and few steps: a 1-2 minute smoke run")
    ap.add_argument("--json", metavar="PATH",
                    help=f"where to write the report as JSON (default: {RESULTS.relative_to(ROOT)}; with --quick: "
                         "the --out directory, so a smoke run never replaces the committed results)")
    ap.add_argument("--plots", metavar="DIR", help="write timelines (planned/measured PNG + Chrome traces) to DIR")
    ap.add_argument("--timeline", action="append", metavar="M,VARIANT",
                    help="whose median step --plots draws (repeatable; default 1,auto/gpipe and 4,auto/1f1b)")
    ap.add_argument("--out", metavar="DIR", help="worker logs and raw records (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before the workers are killed")
    ap.add_argument("--no-bind-cores", dest="bind_cores", action="store_false",
                    help="do not pin each stage's process (all its threads) to its own core (default: pinned, "
                         "like the deepspeed launcher's --bind_cores_to_rank)")
    args = ap.parse_args()
    if args.quick:
        args.seq_len, args.layers, args.hidden, args.heads = 256, 4, 256, 4
        args.micro_batches = "1,2" if args.micro_batches == "1,2,4" else args.micro_batches
        args.warmup, args.steps = 1, 3
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in KNOWN_VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; valid: {', '.join(KNOWN_VARIANTS)}")
    extra: dict[str, dict] = {}
    for item in args.extra_variant:
        name, _, text = item.partition("=")
        try:
            section = json.loads(text)
        except json.JSONDecodeError as err:
            ap.error(f"--extra-variant {item!r}: the part after '=' must be a JSON object ({err})")
        if not name or name in KNOWN_VARIANTS or name in extra or not isinstance(section, dict):
            ap.error(f"--extra-variant {item!r}: use a new NAME and a JSON object, e.g. 'fixed8={{\"slices\": 8}}'")
        extra[name] = section
        variants.append(name)
    opts = {"seq_len": args.seq_len, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "vocab": args.vocab, "micro_batches": [int(x) for x in args.micro_batches.split(",")],
            "variants": variants, "extra_variants": extra, "profile": json.loads(args.profile) if args.profile else None, "warmup": args.warmup, "steps": args.steps,
            "max_rounds": args.max_rounds or 2 * args.steps, "quiet_wait": args.quiet_wait,
            "foreign_max": args.foreign_max, "bind_cores": args.bind_cores}
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="pipeline_speedup-"))
    print(f"2 stages x 1 thread, GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab "
          f"{args.vocab}, seq_len {args.seq_len}, micro-batch 1, m in {opts['micro_batches']}; "
          f"{args.warmup} warm-up + {args.steps} timed rounds; logs in {out_dir}", flush=True)
    started = time.perf_counter()
    ranks = launch(out_dir, opts, args.timeout)
    report = analyse(ranks, opts)
    print()
    report["table"] = print_tables(report, opts)
    report["cost_model"] = cost_model_check(report)
    if report["cost_model"]:
        print("\nCost model vs measured (sum over the step's slices, per stage; overhead = per-action ms the "
              "profile does not see):")
        for c in report["cost_model"]:
            print(f"  m={c['m']} {c['variant']:<10} stage {c['stage']} {c['kind']}: predicted {c['predicted_ms']:.0f} "
                  f"measured {c['measured_ms']:.0f} ({100 * c['err']:+.1f}%), overhead "
                  f"{c['per_action_overhead_ms']:+.2f} ms/action")
    print("\nTargets:")
    report["targets"] = check_targets(report)
    if args.plots:
        report["plots"] = []
        have = {(r["m"], r["variant"]) for r in report["rows"]}
        for item in args.timeline or ["1,auto/gpipe", "4,auto/1f1b"]:
            m_str, variant = item.split(",", 1)
            if (int(m_str), variant) not in have:
                print(f"--timeline {item}: not measured in this run, skipped")
                continue
            plots = write_plots(report, (int(m_str), variant), Path(args.plots), out_dir)
            report["plots"].append(plots)
            print(f"timelines: {plots['measured_png']} {plots.get('planned_png', '')}")
    wall = time.perf_counter() - started
    report.update(options=opts, wall_s=wall, command=" ".join([Path(sys.executable).name, *sys.argv]),
                  git=_git_describe(),
                  machine={"cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": ranks[0]["torch"],
                           "deepspeed": ranks[0]["deepspeed"], "threads_per_rank": ranks[0]["threads"]})
    print(f"\nwall time {wall:.0f} s")
    json_path = Path(args.json) if args.json else (out_dir / "pipeline_speedup.json" if args.quick else RESULTS)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1))
    print(f"report: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
