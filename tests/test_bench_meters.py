"""Tier a: the benchmark library's meters and round statistics measure what they claim (benchmarks/benchlib)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from benchmarks.benchlib.alternate import alternate, median_index, paired_ratios, rounds_in_use
from benchmarks.benchlib.meters import (KINDS, ActivationMeter, HeapMeter, InstructionRecorder, compute_events,
                                        step_summary)

MiB = 2**20


def test_heap_meter_sees_a_temporary_freed_before_the_step_ends() -> None:
    meter = HeapMeter()
    a = torch.randn(256, 256)
    with meter:
        big = torch.ones(4_000_000)          # 16 MB, freed before the step ends
        kept = (big * 2).sum()
        del big
        small = a @ a                        # 256 KB, still alive at the end
    mib = meter.peak_bytes / MiB
    assert 30 <= mib <= 34, f"peak {mib:.1f} MiB: expected the two 16 MB tensors alive at once"
    assert meter.peak_at.endswith(("aten.mul.Tensor", "aten.sum.default")), meter.peak_at
    assert kept.item() == 8_000_000 and small.shape == (256, 256)


def test_heap_meter_counts_backward_temporaries() -> None:
    w = torch.randn(1024, 1024, requires_grad=True)
    x = torch.randn(2048, 1024)
    meter = HeapMeter()
    with meter:
        (x @ w).relu().sum().backward()
    # relu keeps its 8 MB output for backward; threshold_backward then makes the 8 MB grad of x @ w
    assert 16 * MiB <= meter.peak_bytes <= 24 * MiB, meter.peak_bytes / MiB
    assert "backward" in meter.peak_at, meter.peak_at


def test_activation_meter_counts_each_saved_storage_once_and_no_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    meter = ActivationMeter(SimpleNamespace(module=model))   # an engine without KV buffers or W stashes
    x = torch.randn(1024, 256)                               # 1 MiB
    with meter:
        loss = model(x).sum()
        # saved: x (first Linear), the ReLU output (saved by ReLU *and* the second Linear: one storage);
        # not counted: the Linear weights (parameters)
        assert meter.saved_bytes == 2 * MiB
        loss.backward()
    assert meter.peak_saved == meter.peak_total == 2 * MiB
    assert meter.saved_bytes == 0 and not meter.live, "autograd freed everything it saved"


def test_step_summary_splits_a_step_into_compute_waiting_and_tail() -> None:
    # (instruction, micro-batch, slice, start ms, end ms) as InstructionRecorder records them
    records = [("LoadMicroBatch", 0, 0, 100, 101), ("RecvActivation", 0, 0, 101, 110),
               ("ForwardPass", 0, 0, 110, 130), ("SendActivation", 0, 0, 130, 131),
               ("BackwardPass", 0, 0, 150, 190), ("WeightGradPass", 0, 0, 190, 200),
               ("OptimizerStep", 0, 0, 200, 205)]
    s = step_summary(records, 100.0, 210.0, compute_cpu_ms=35.0)
    assert (s["step_ms"], s["forward_ms"], s["backward_ms"], s["weight_ms"], s["busy_ms"]) == (110, 20, 40, 10, 70)
    assert (s["recv_ms"], s["send_ms"], s["tail_ms"], s["load_ms"]) == (9, 1, 5, 1)
    assert s["outside_ms"] == 110 - 86                       # 19 ms idle between send and backward, 5 after
    assert (s["compute_start_ms"], s["compute_end_ms"], s["num_forward"]) == (10, 100, 1)
    assert s["cpu_share"] == 0.5


def test_round_statistics() -> None:
    rounds = [{"round": 0, "clean": True}, {"round": 1, "clean": False}, {"round": 2, "clean": True},
              {"round": 3, "clean": True}]
    assert rounds_in_use(rounds, steps=3) == {0, 2, 3}
    assert rounds_in_use(rounds[:3], steps=3) == {0, 1, 2}   # two clean of three wanted: use all, say so
    assert paired_ratios({0: 100.0, 1: 90.0, 2: 80.0}, {0: 50.0, 2: 40.0, 5: 1.0}) == [2.0, 2.0]
    assert median_index([5.0, 1.0, 3.0, 9.0]) in (0, 2)    # median 4: nearest values 3 and 5


class _QuietCpu:
    """A CpuMeter stand-in for rank 0 that never waits (run_step reports the foreign load itself)."""

    def wait_quiet(self, max_s: float) -> float:
        return 0.0


def test_alternate_rotates_the_order_and_runs_until_enough_clean_rounds(capsys) -> None:
    loads = iter([0.0, 0.0,  0.0, 0.0,  0.9, 0.0,  0.0, 0.0,  0.0, 0.0])   # 1 warm-up round, then timed ones
    calls: list[tuple[str, int | None]] = []

    def run_step(name: str, rnd: int | None) -> dict:
        calls.append((name, rnd))
        return {"step_ms": 10.0, "foreign_cores": next(loads)}

    rounds = alternate(["a", "b"], run_step, warmup=1, steps=3, max_rounds=10, quiet_wait=0.0, foreign_max=0.2,
                       cpu=_QuietCpu(), rank=0, label="m=1", broadcast=lambda decision: decision)
    assert calls == [("a", None), ("b", None), ("b", 0), ("a", 0), ("a", 1), ("b", 1), ("b", 2), ("a", 2),
                     ("a", 3), ("b", 3)]
    assert [(r["round"], r["clean"]) for r in rounds] == [(0, True), (1, False), (2, True), (3, True)]
    assert rounds[1]["foreign_cores"] == {"a": 0.9, "b": 0.0}
    assert capsys.readouterr().out.splitlines()[1].startswith("[rank 0] m=1 round 1 NOISY")


def test_alternate_stops_at_max_rounds_when_the_machine_stays_busy() -> None:
    rounds = alternate(["a"], lambda name, rnd: {"step_ms": 1.0, "foreign_cores": 1.0}, warmup=0, steps=3,
                       max_rounds=4, quiet_wait=0.0, foreign_max=0.2, cpu=_QuietCpu(), rank=1, label="",
                       broadcast=lambda decision: decision)
    assert len(rounds) == 4 and not any(r["clean"] for r in rounds)


def test_instruction_recorder_sees_the_token_schedules_microbatch_slice_and_chunk() -> None:
    """The recorder reads the fields TokenPipeSchedule's instructions carry, as the engine's dispatch passes them
    (``handler(engine, **cmd.kwargs)``): a timeline whose slices all read 0 would hide the token pipeline."""
    from ds_terapipe.runtime.execution.schedule import TokenPipeSchedule

    sched = TokenPipeSchedule("interleaved-1f1b", micro_batches=2, stages=2, stage_id=1, num_slices=2,
                              virtual_stages=2)

    class FakeEngine:
        _INSTRUCTION_MAP = {cls: (lambda self, **kw: None) for cls in
                            {type(cmd) for step in sched.steps() for cmd in step}}

    engine = FakeEngine()
    rec = InstructionRecorder(engine, stage=1)
    expected = []
    for step in sched.steps():
        for cmd in step:
            engine._INSTRUCTION_MAP[type(cmd)](engine, **cmd.kwargs)
            if type(cmd).__name__ in KINDS:
                expected.append((KINDS[type(cmd).__name__], cmd.kwargs["chunk"], cmd.kwargs["microbatch"],
                                 cmd.kwargs["slice_index"]))
    got = [(k, c, mb, sl) for _, k, mb, sl, _, _, c in compute_events(rec.records, 1, 0.0, rec.chunks)]
    assert got == expected
    assert {(c, sl) for _, c, _, sl in got} == {(1, 0), (1, 1), (3, 0), (3, 1)}


def test_peer_chunk_placement_is_torch_pipelinings_own() -> None:
    """The torch peers build each rank's chunks by ``chunk_rank``; torch's schedules route activations by their
    own stage-to-rank map. A disagreement would run a chunk on a rank torch sends nothing to (a hang)."""
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    from benchmarks.benchlib.peers import chunk_rank
    for ranks in (1, 2, 3, 4):
        v_shape = generate_stage_to_rank_mapping(ranks, 2 * ranks, style="v")
        assert {c: chunk_rank(c, ranks, True) for c in range(2 * ranks)} == v_shape
        for chunks in (ranks, 2 * ranks, 3 * ranks):
            looped = generate_stage_to_rank_mapping(ranks, chunks, style="loop")
            assert {c: chunk_rank(c, ranks, False) for c in range(chunks)} == looped
