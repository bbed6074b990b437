"""One process (world size 1, gloo): DeepSpeed's fp16 optimizers at ZeRO 0 (``FP16_UnfusedOptimizer``, the fused
``FP16_Optimizer``) step their wrapped optimizer on zero gradients when built; after
:func:`~ds_terapipe.runtime.execution.optimizer_init.undo_construction_step` their fp32 masters move as torch's
optimizer moves an fp32 copy on the same gradients (SGD with momentum and weight decay, Adam with coupled decay,
AdamW), 4 steps. The engine calls it at init (tests/test_freeze_precision.py trains fp16 at ZeRO 0 with weight
decay against the fp32 reference)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from ds_terapipe.runtime.execution.local_launch import free_port
from ds_terapipe.runtime.execution.shm import remove_shm_segments

SCRIPT = textwrap.dedent("""
    import json, torch, ds_terapipe
    ds_terapipe.init_distributed(dist_backend="gloo")
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from ds_terapipe.runtime.execution.optimizer_init import undo_construction_step

    OPTIMIZERS = {"SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
                  "Adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1),
                  "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)}
    errors, undone = {}, {}
    for wrapper in (FP16_UnfusedOptimizer, FP16_Optimizer):
        for name, make in OPTIMIZERS.items():
            gen = torch.Generator().manual_seed(0)
            w0 = 1 + torch.rand(64, generator=gen)
            grads = [torch.randn(64, generator=gen) * 0.01 for _ in range(4)]
            half = torch.nn.Parameter(w0.half())
            opt = wrapper(make([half]), static_loss_scale=1024.0, dynamic_loss_scale=False)
            undone[wrapper.__name__] = undo_construction_step(opt)
            ref = torch.nn.Parameter(w0.half().float())
            ref_opt = make([ref])
            for g in grads:
                half.grad = (g.half().float() * 1024).half()
                opt.step()
                ref.grad = g.half().float()
                ref_opt.step()
            master = opt.fp32_groups[0][0] if wrapper is FP16_UnfusedOptimizer else opt.fp32_groups_flat[0]
            start = w0.half().float()
            errors[f"{wrapper.__name__} {name}"] = float(((master.detach() - start) - (ref.detach() - start)).norm()
                                                         / (ref.detach() - start).norm())
    undone["SGD"] = undo_construction_step(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))
    print("RESULT", json.dumps({"errors": errors, "undone": undone}))
""")


def test_an_fp16_zero0_optimizer_after_the_undo_steps_as_torchs_does() -> None:
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    try:
        run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    finally:
        remove_shm_segments(port)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert result["undone"] == {"FP16_UnfusedOptimizer": True, "FP16_Optimizer": True, "SGD": False}
    # the same gradients rounded to fp16 either way: what is left is the masters' fp32 arithmetic
    assert all(err < 1e-5 for err in result["errors"].values()), result["errors"]
