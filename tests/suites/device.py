"""Suite ``device`` (standalone, 2 ranks), asserted on by tests/test_device_collectives.py:
``python tests/dist_worker.py device OUT_DIR {}`` (env: RANK, WORLD_SIZE, ...).

NCCL refuses CPU tensors, but on a CPU-only machine every tensor is a CPU tensor, so "is it on the
accelerator?" cannot be read off ``tensor.device``. This suite makes the question answerable:

1. The accelerator reports a device of its own, ``cpu:7`` (:data:`FAKE_DEVICE`): DeepSpeed's engine takes it
   as ``engine.device``, and torch accepts it for allocation (the tensors land on ``cpu``).
2. :class:`HostTracker`, a ``TorchFunctionMode`` active for the whole run, marks every tensor made on the host:
   a factory (``torch.tensor``, ``zeros``, ``full``, ...) without ``device=`` the accelerator's device,
   ``.cpu()``, ``.to(<other device>)``, and whatever is computed from host tensors alone. ``.to(engine.device)``
   and factories given that device make accelerator tensors; so does every op with an accelerator input,
   and autograd's backward (which the mode does not see), exactly as on a GPU.
3. Every ``torch.distributed`` call (collectives and p2p, ours and DeepSpeed's) is wrapped: a host tensor is
   refused with an error naming the call; an ``*_object`` collective is refused unless the accelerator's
   current device was set to this rank's first (NCCL picks the objects' device from it). An op mixing a
   host tensor (not a 0-dim scalar) with accelerator tensors is refused too, as a GPU would.

Limits: ``device=x.device`` reads ``cpu`` here for any tensor, so an explicit plain ``"cpu"`` counts as the
accelerator's device (a hard-coded ``device="cpu"`` goes unnoticed; a missing ``device=`` does not), and
tensors made where the mode cannot see (inside autograd's backward, by C++ code) count as on the accelerator.

The run covers what the runtime does with processes: slices "auto" (slice check, profiling, plan broadcast),
training, a second sequence length, eval, checkpoint save and load, and the measured timeline
(``trace_dir``), whose every clock read must follow an accelerator synchronize. Writes ``OUT_DIR/rank{R}.json``.
The suite owns its process: it installs its guards and starts its tracking mode before ds_terapipe is imported
and before the process group starts.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from tests.suites import suite

RANK = int(os.environ["RANK"])
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", RANK))
FAKE_DEVICE = torch.device("cpu", 7)
_HOST = "_device_test_on_host"


def on_host(t: torch.Tensor) -> bool:
    return getattr(t, _HOST, False)


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _is_device(value: Any) -> bool:
    return isinstance(value, (torch.device, str)) and not isinstance(value, torch.dtype)


class DeviceViolation(RuntimeError):
    """A tensor made on the host reached torch.distributed, or met an accelerator tensor in one op."""


# Ops that accept host tensors beside device ones on a GPU: indexing with host indices, copies between devices.
_MAY_MIX = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.copy_, torch.Tensor.index_select}


class HostTracker(TorchFunctionMode):
    """Marks tensors made on the host (see the module docstring); everything else is on the accelerator."""

    def __init__(self, accelerator_device: torch.device) -> None:
        super().__init__()
        self.accelerator_device = accelerator_device

    def _host_device(self, device: Any) -> bool:
        """Whether an explicit ``device=`` means the host. A plain ``cpu`` is taken as the accelerator's: on
        this machine ``device=x.device`` reads ``cpu`` for an accelerator tensor too, and the idiom is right on
        a GPU (a hard-coded ``"cpu"`` therefore goes unnoticed; a missing ``device=`` does not)."""
        device = torch.device(device)
        return device != self.accelerator_device and device != torch.device("cpu")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.Tensor.data.__set__:  # param.data = x: the parameter now holds x's storage
            if torch.is_tensor(args[1]):
                setattr(args[0], _HOST, on_host(args[1]))
            return out
        outputs = _tensors(out)
        if func is torch.Tensor.to and outputs and outputs[0] is args[0]:
            # a no-op here (every tensor is on the CPU) is a copy to the named device on a GPU: a host tensor
            # sent to the accelerator's device is on it from now on
            if self._verdict(func, args, kwargs) is False:
                setattr(out, _HOST, False)
            return out
        if not outputs or (args and outputs[0] is args[0]):
            return out  # nothing made, or in place: the tensor stays where it is
        host = self._verdict(func, args, kwargs)
        if host is not None:
            for t in outputs:
                try:
                    setattr(t, _HOST, host)
                except (AttributeError, RuntimeError):  # pragma: no cover - tensors that refuse attributes
                    pass
        return out

    def _verdict(self, func, args, kwargs) -> bool | None:
        """True: made on the host; False: on the accelerator; None: the output is an input (in-place)."""
        if func is torch.Tensor.cpu:
            return True
        if func is torch.Tensor.to:
            for value in (*args[1:], kwargs.get("device"), kwargs.get("other")):
                if torch.is_tensor(value):
                    return on_host(value)
                if value is not None and _is_device(value):
                    return self._host_device(value)
            return on_host(args[0])  # a dtype change stays where it was
        if kwargs.get("device") is not None:
            return self._host_device(kwargs["device"])
        inputs = _tensors(args) + _tensors(kwargs)
        if not inputs:
            return True  # a factory without device=: torch's default device, the host
        host = [t for t in inputs if on_host(t)]
        if host and len(host) < len(inputs) and func not in _MAY_MIX:
            big = [t for t in host if t.dim() > 0]  # a 0-dim host tensor is a scalar to CUDA kernels too
            if big:
                raise DeviceViolation(f"{getattr(func, '__name__', func)} mixes a {tuple(big[0].shape)} tensor made on "
                                      f"the host with tensors on the accelerator's device {FAKE_DEVICE}: a GPU "
                                      "refuses this (tensors on different devices)")
        return len(host) == len(inputs)




CHECKED: dict[str, int] = {}
STATE: dict[str, Any] = {"set_device": None, "syncs": 0, "inside_object_call": False}

_TENSOR_CALLS = ["all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce",
                 "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "gather", "scatter", "send",
                 "recv", "isend", "irecv", "all_to_all", "all_to_all_single", "all_reduce_coalesced",
                 "batch_isend_irecv"]
_OBJECT_CALLS = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                 "send_object_list", "recv_object_list"]


def _guard(name: str, original: Callable) -> Callable:

    def checked(*args, **kwargs):
        if STATE["inside_object_call"]:  # torch's own tensors of an *_object call: its device rule is below
            return original(*args, **kwargs)
        CHECKED[name] = CHECKED.get(name, 0) + 1
        if name in _OBJECT_CALLS:
            if STATE["set_device"] != LOCAL_RANK:
                raise DeviceViolation(f"rank {RANK}: torch.distributed.{name} before the accelerator's current device "
                                      f"was set to local rank {LOCAL_RANK} (set_device got {STATE['set_device']}); "
                                      "NCCL would put the objects on another rank's device")
            STATE["inside_object_call"] = True
            try:
                return original(*args, **kwargs)
            finally:
                STATE["inside_object_call"] = False
        else:
            values = list(args) + list(kwargs.values())
            if name == "batch_isend_irecv":
                values = [op.tensor for op in values[0]]
            for t in _tensors(values):
                if on_host(t):
                    raise DeviceViolation(f"rank {RANK}: torch.distributed.{name} got a {tuple(t.shape)} {t.dtype} "
                                          f"tensor made on the host, not on the accelerator's device "
                                          f"{FAKE_DEVICE}; NCCL refuses it. Create it with device=engine.device")
        return original(*args, **kwargs)

    return checked


def install() -> None:
    """Fake accelerator device, set_device and synchronize spies, torch.distributed guards."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    acc.device_name = lambda device_index=None: str(FAKE_DEVICE)
    acc.current_device_name = lambda: str(FAKE_DEVICE)
    acc.device = lambda device_index=None: FAKE_DEVICE
    acc.set_device = lambda device_index: STATE.update(set_device=int(device_index))
    acc.synchronize = lambda device_index=None: STATE.update(syncs=STATE["syncs"] + 1)
    for module in (dist, dist.distributed_c10d):
        for name in _TENSOR_CALLS + _OBJECT_CALLS:
            if hasattr(module, name) and not hasattr(getattr(module, name), "__wrapped_device_check__"):
                guarded = _guard(name, getattr(module, name))
                guarded.__wrapped_device_check__ = True
                setattr(module, name, guarded)


def batches(vocab: int, seq_len: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (2, seq_len + 1), generator=gen)  # made on the host, as a loader does
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def run(out_dir: Path) -> dict[str, Any]:
    import ds_terapipe
    from ds_terapipe.models.gpt import GPTConfig, causal_lm_loss, gpt_layer_specs

    ds_terapipe.init_distributed(dist_backend="gloo")
    # DeepSpeed's shared-memory all-reduce (CPU, inference only) was not built: no /dev/shm segment of this run, and
    # deepspeed.comm's inference all-reduce takes the process group's
    from deepspeed.comm import comm as ds_comm

    summed = torch.full((3,), float(RANK + 1), device=FAKE_DEVICE)
    ds_comm.inference_all_reduce(summed)
    shm = {"op_built": ds_comm.cdb.shm_comm_op is not None, "inference_sum": summed.tolist(),
           "segments": sorted(glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{os.environ['MASTER_PORT']}_*"))}
    cfg = GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=3)

    def engine_for(terapipe: dict) -> Any:
        model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=2, loss_fn=causal_lm_loss,
                                                vocab_size=cfg.vocab_size, partition_method="uniform")
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 4,
                  "steps_per_print": 10**9, "terapipe": dict(terapipe, enabled=True, seq_len=32, granularity=8)}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, config=config)
        assert engine.device == FAKE_DEVICE, engine.device
        return engine

    # slices "auto": slice check, profiling, the plan broadcast; a second length planned from the costs
    auto = engine_for({"slices": "auto", "profile": {"slice_lengths": [8, 32], "num_contexts": 2, "warmup": 0,
                                                     "repeats": 1}})
    losses = [float(auto.train_batch(iter(batches(cfg.vocab_size, length, 2, length)))) for length in (32, 16)]
    result: dict[str, Any] = {"auto_slices": list(auto.slices), "shm": shm}
    # two slices (the KV prefix, unequal per-length shapes on the wire), eval, checkpoints, the timeline
    engine = engine_for({"slices": 2, "schedule": "1f1b", "trace_dir": str(out_dir / "traces")})
    for seq_len, seed in ((32, 1), (16, 2)):
        before = STATE["syncs"]
        losses.append(float(engine.train_batch(iter(batches(cfg.vocab_size, seq_len, 2, seed)))))
        result[f"syncs_{seq_len}"] = STATE["syncs"] - before
        result[f"timed_{seq_len}"] = len(engine.last_timeline)
        result[f"slices_{seq_len}"] = list(engine.slices)
    losses.append(float(engine.eval_batch(iter(batches(cfg.vocab_size, 32, 2, 3)))))
    engine.save_checkpoint(str(out_dir / "ckpt"), tag="t1")
    engine.load_checkpoint(str(out_dir / "ckpt"), tag="t1")
    losses.append(float(engine.train_batch(iter(batches(cfg.vocab_size, 32, 2, 4)))))
    result.update(losses=losses, checked=dict(CHECKED), set_device=STATE["set_device"])
    return result


@suite("device", standalone=True)
def suite_device(out_dir: Path, extra: dict) -> None:
    install()
    with HostTracker(FAKE_DEVICE):
        result = run(out_dir)
    (out_dir / f"rank{RANK}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()
