"""Tier b: a fixed selection of the randomized cross-feature cases (tests/fuzz.py, suite ``fuzz``): combinations
that need an engine rule of their own (each rule named beside its case), and a few broad ones that switch many
features on at once. One launch per world size; every case must match the unsliced reference (loss, every
first-step gradient in fp32 at ZeRO 0, the parameters or the fp32 master weights' change after the case's steps,
an evaluation where asked, tied and replicated copies equal, the same steps skipped and layers frozen); a few
cases must be refused on every rank with the rule in the message. ``python -m tests.fuzz --seeds 0-40 --world 2``
runs random ones.
"""

from __future__ import annotations

import pytest

from tests.fuzz import describe, plain_case, run_cases

pytestmark = pytest.mark.multiproc

WORLD2 = [
    # bf16 at ZeRO 0 with the embedding frozen from step 0 and an untied head (the embedding's tied key on one
    # stage only): BF16_Optimizer makes no master gradient for the frozen weight, which DeepSpeed's tied-gradient
    # reduction reads; the engine gives it None, which the reduction skips (else AttributeError on stage 0, and
    # stage 1 waits in the optimizer's norm)
    plain_case("bf16 frozen untied embedding", precision="bf16", tied=False, freeze=1, freeze_at=0),
    # plan_per_batch with replicas whose micro-batches have different lengths: every rank plans replica 0's first
    # length (a replica agreeing its own length's document profile would all-reduce another size and hang)
    plain_case("per-batch plans, replicas of other lengths", stages=1, schedule="gpipe", slices="auto",
               granularity=8, micro=1, packed=True, per_batch=True, lengths=[16, 32, 48]),
    # eval_batch(num_micro_batches=2) after a repack onto 2 replicas reads the 2 micro-batches it read before the
    # repack, one per replica (not 2 per replica, which runs out)
    plain_case("eval count after a repack", freeze=3, repack=True, eval=True, eval_count=2),
    # broad: vocabulary parallelism (untied, a vocabulary not divisible by the ranks) over packed rows of mixed
    # lengths, interleaved chunks, activation checkpointing, clipping, an evaluation
    plain_case("vocab packed mixed", schedule="interleaved-1f1b", layers=4, vocab=63, tied=False, slices=3,
               vocab_parallel=True, packed=True, lengths=[48, 32, 16], ckpt=1, clip=True, ignored=True, eval=True),
    # broad: one stage x 2 sequence ranks, zbv, bf16, the embedding frozen from step 1, resumed from a checkpoint
    plain_case("sequence zbv bf16 freeze resume", stages=1, seq=2, schedule="zbv", slices=[16, 8, 24], micro=2,
               precision="bf16", freeze=2, resume=True, eval=True),
    # broad: each chunk sharded over 2 replicas, looped-bfs, weight decay, clipping, kept whole for the step
    plain_case("sharded looped-bfs", stages=1, schedule="looped-bfs", layers=3, slices=4, shard=True,
               release="step", clip=True, wd=0.01, eval=True),
    # a sharded Llama resumed from a checkpoint: a layer loads its parameters and persistent buffers, not the
    # rotary embedding's inv_freq, which no state dict holds (else RuntimeError: missing keys in load_checkpoint)
    plain_case("sharded llama resume", model="llama", stages=1, schedule="gpipe", slices=6, shard=True, resume=True),
    # the auto freeze policy with vocabulary parallelism: the output layer's rows train beside the last chunk's
    # backward, so the layer with parameters in front of it never freezes (counting the head's rows as that
    # layer freezes the final norm, the last chunk drops its backward and the head stops training); AdamW
    plain_case("vocab auto freeze", vocab_parallel=True, optimizer="adamw", steps=3,
               auto_freeze={"check_interval": 1, "warmup_steps": 0, "tolerance": 1e6, "aggressiveness": 1.0}),
    # fp16 under a dynamic loss scale, Adam, 4 steps: the second overflows, skipped on every rank and not counted
    # by the freeze schedule (its layers freeze, and repack, before the fourth batch: the third step taken)
    plain_case("fp16 overflow freeze", precision="fp16", optimizer="adam", steps=4, overflow=1,
               scale={"initial_scale_power": 8, "loss_scale_window": 1, "hysteresis": 1}, freeze=3, freeze_at=2,
               repack=True),
    # bf16 at ZeRO 0, looped-bfs, every layer of stage 1's own frozen (its chunks: a block, the final norm and the
    # tied head, whose copy DeepSpeed leaves out of the norm): that rank lists no gradient for BF16_Optimizer's norm,
    # which then adds a zero (else RuntimeError: stack expects a non-empty TensorList, and its peers wait)
    plain_case("bf16 looped-bfs stage frozen but its tied copy", schedule="looped-bfs", precision="bf16", freeze=3,
               freeze_at=1, micro=1, steps=3),
]

WORLD4 = [
    # broad: 2 stages x 2 replicas, zbv, ZeRO 1, vocabulary parallelism over packed rows, clipping, a freeze that
    # repacks onto 1 stage x 4 replicas, an evaluation after it (the case that first met the repack's eval rule)
    plain_case("zbv zero1 vocab repack", schedule="zbv", layers=4, vocab=63, slices=4, micro=4, deferred=True,
               ckpt=1, zero=1, vocab_parallel=True, packed=True, ignored=True, clip=True, freeze=4, repack=True,
               eval=True),
    # broad: 2 stages x 2 sequence ranks, dualpipev, vocabulary parallelism, clipping, resumed from a checkpoint
    plain_case("sequence dualpipev vocab resume", seq=2, schedule="dualpipev", layers=3, slices=6, micro=4,
               vocab_parallel=True, clip=True, fuse=False, resume=True, eval=True),
]


#: cases the engine must refuse on every rank at init, each with the words its message must hold
REFUSED2 = [
    # vocabulary parallelism with every layer that has parameters in front of the output layer frozen: the output
    # layer's rows train beside the last chunk's backward, which that freeze would remove
    (plain_case("vocab freeze up to the head", vocab_parallel=True, freeze=4),
     "with vocab_parallel the output layer's rows train through the vocabulary passes"),
]


def _check(verdicts: list[dict], cases: list[dict]) -> None:
    assert [v["id"] for v in verdicts] == [c["id"] for c in cases], [v["id"] for v in verdicts]
    bad = [f"{v['id']}: {v['outcome']} {v.get('why', '')} {v.get('message', '')[:400]} -- {describe(v['case'])}"
           for v in verdicts if v["outcome"] != "pass"]
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, cases, refused", [(2, WORLD2, REFUSED2), (4, WORLD4, [])], ids=["world2", "world4"])
def test_fuzz_selection(world: int, cases: list[dict], refused: list[tuple[dict, str]], tmp_path) -> None:
    verdicts = run_cases(cases + [case for case, _ in refused], world, tmp_path, per_launch=len(cases) + len(refused),
                         case_timeout_s=120, echo=False)
    _check(verdicts[:len(cases)], cases)
    for v, (case, words) in zip(verdicts[len(cases):], refused):
        assert v["id"] == case["id"] and v["outcome"] == "refused" and words in v.get("message", ""), v
