"""Tier b, one 2-rank launch: every tensor handed to torch.distributed is on the accelerator's device.

tests/suites/device.py gives the accelerator a device of its own, marks every tensor made on the host and
refuses one at any torch.distributed call (ours and DeepSpeed's), through slice check, profiling, planning,
training at two sequence lengths, eval, checkpoint save and load; it also counts accelerator synchronizes
around the measured timeline. On CPU nothing else would notice a ``torch.tensor(...)`` without
``device=engine.device``; NCCL would refuse it on the first step.
"""

from __future__ import annotations

import json

import pytest

from tests.dist_harness import run_ranks, suite_command

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(400)
def test_every_distributed_tensor_is_on_the_accelerator_device(tmp_path) -> None:
    codes, texts = run_ranks(suite_command("device", tmp_path), 2, tmp_path, timeout_s=300)
    assert codes == [0, 0], "\n".join(f"--- rank {r} (exit {c})\n{t[-4000:]}" for r, (c, t) in
                                      enumerate(zip(codes, texts)))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        checked = result["checked"]
        # the guard saw the runtime's own traffic, not just some of it
        for name in ("all_reduce", "isend", "irecv", "broadcast", "all_gather_object", "broadcast_object_list"):
            assert checked.get(name, 0) > 0, (rank, name, checked)
        assert result["set_device"] == rank  # DeepSpeed set the current device before any *_object collective
        # ds_terapipe.init_distributed kept DeepSpeed from building its shared-memory all-reduce (a C++ build on a
        # machine's first run, a 66 MB /dev/shm segment per process); its inference all-reduce still sums
        assert result["shm"] == {"op_built": False, "inference_sum": [3.0] * 3, "segments": []}, result["shm"]
        assert len(result["losses"]) == 6 and all(loss == loss for loss in result["losses"])  # no NaN
        for seq_len in (32, 16):  # the timeline syncs before and after each timed action (DeepSpeed adds a few)
            assert result[f"timed_{seq_len}"] > 0
            assert result[f"syncs_{seq_len}"] >= 2 * result[f"timed_{seq_len}"], result
