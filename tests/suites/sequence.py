"""Suite ``sequence``, asserted on by tests/test_sequence_parallel.py: sequence parallelism inside the token pipeline
(terapipe.sequence_parallel) against the unsliced single-process reference: 2 stages x 2 sequence ranks (x the
replicas the world leaves), the reference GPT and a Hugging Face Llama with grouped-query attention, gpipe and 1f1b,
m in {1, 3}, unequal slices; loss, every first-step gradient and the parameters after 3 SGD + momentum steps on
every rank; a checkpoint resumed at the same layout; the refusals; last, a sequence rank failing mid-step stops its
peers in seconds. ``extra``: ``cases`` ([model, schedule, micro, slices, zero stage, clipping]), ``features`` (the
checkpoint and refusal cases), ``fault``; ``init_fault`` alone: a sequence rank failing in init's profile.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

import torch

import ds_terapipe
from ds_terapipe.models.gpt import GPTConfig, causal_lm_loss, gpt_layer_specs
from tests.suites import packed as packed_suite
from tests.suites import suite
from tests.suites.common import (CLIP, ENGINE_REF, STATUS, WORLD, allow_fp16_on_cpu, build_spec_layers, deltas,
                                 first_step_grads, frozen_reference, linger_until_peers_stop, make_batches,
                                 master_weights, named_compare, rel_err, replica_batches, run_cases, run_until_error,
                                 train_steps)
from tests.suites.common_vocab import rows_compare

STAGES, DEGREE = 2, 2
SEQ_LEN, BATCH, STEPS = 48, 2, 3
UNEQUAL = [16, 24, 8]


def _model(name: str) -> tuple[list, int]:
    """(layer specs, vocabulary) of ``name``: the reference GPT (learned positions, 4 heads), a Hugging Face Llama
    (rotary positions, 4 query heads over 2 key/value heads: one KV head per sequence rank), the same as Mistral
    with a sliding window of 10 keys (shorter than some slices, longer than others), gpt-oss (attention sinks, one
    per head: a rank trains its heads' sinks; sliding and full layers; 4 experts), DeepSeek-V3 (latent attention,
    keys of 8 + 4 dims and values of 6; a dense layer, then 4 experts in 2 groups) or Llama 4 (chunks of 20 tokens,
    a NoPE layer whose temperature tuning reads each rank's true token index; 4 experts)."""
    if name == "gpt":
        cfg = GPTConfig(num_layers=4, hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=11)
        return gpt_layer_specs(cfg), cfg.vocab_size
    import transformers

    from ds_terapipe.models.hf import causal_lm_specs

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    if name == "mistral":
        config = transformers.MistralConfig(**sizes, sliding_window=10)
    elif name == "gpt_oss":
        config = transformers.GptOssConfig(**sizes, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=10, layer_types=["sliding_attention", "full_attention"] * 2)
    elif name == "deepseek_v3":
        config = transformers.DeepseekV3Config(**dict(sizes, num_key_value_heads=4), q_lora_rank=16, kv_lora_rank=8,
                                               qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                               n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                               n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1)
    elif name == "llama4_text":
        config = transformers.Llama4TextConfig(**sizes, head_dim=8, attention_chunk_size=20,
                                               no_rope_layers=[1, 1, 0, 1], attn_temperature_tuning=True,
                                               floor_scale=4, attn_scale=0.5,
                                               num_local_experts=4, num_experts_per_tok=2, moe_layers=[1, 3],
                                               intermediate_size_mlp=64)
    else:
        config = transformers.LlamaConfig(**sizes)
    return causal_lm_specs(config, seed=5), config.vocab_size


def _engine(specs: list, vocab: int, schedule: str, micro: int, slices: Any, zero: int, clip: float,
            degree: int = DEGREE, extra: Optional[dict] = None, precision: Optional[dict] = None) -> Any:
    dp = WORLD // (STAGES * degree)
    # slices "auto": profiled at init (each rank's share with its all-to-alls), on a small grid
    auto = {"granularity": 8, "profile": {"slice_lengths": [8, 24, 48], "num_contexts": 2, "warmup": 0,
                                          "repeats": 1}} if slices == "auto" else {}
    terapipe = {"enabled": True, "seq_len": SEQ_LEN, "slices": slices, "schedule": schedule, "p2p_timeout_s": 60,
                "sequence_parallel": degree, **auto, **(extra or {})}
    model = ds_terapipe.TokenPipelineModule(specs, num_stages=STAGES, loss_fn=causal_lm_loss, vocab_size=vocab,
                                            partition_method="uniform",
                                            **ds_terapipe.module_chunk_kwargs(
                                                ds_terapipe.parse_terapipe_config({"terapipe": terapipe})))
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": micro,
              "train_batch_size": BATCH * micro * dp, "steps_per_print": 10**9, "gradient_clipping": clip,
              "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True, "terapipe": terapipe,
              **(precision or {})}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, config=config)
    ENGINE_REF["engine"] = engine
    return engine


def _frozen_at(freeze: Optional[list]) -> Any:
    """The reference's count of frozen front layers at each step, from a ``freeze.schedule``."""
    return lambda step: max([count for at, count in (freeze or []) if at <= step], default=0)


def _case(model: str, schedule: str, micro: int, slices: Any, zero: int = 0, clip: bool = False,
          vocab_parallel: bool = False, freeze: Optional[list] = None, compile_backend: Optional[str] = None
          ) -> dict[str, Any]:
    specs, vocab = _model(model)
    dp = WORLD // (STAGES * DEGREE)
    batches = make_batches(GPTConfig(vocab_size=vocab), STEPS * micro * dp, BATCH, SEQ_LEN, seed=77 + micro)
    ref = frozen_reference(_model(model)[0], batches, STEPS, _frozen_at(freeze), max_norm=CLIP if clip else 0.0)
    extra = {**({"vocab_parallel": True} if vocab_parallel else {}),
             **({"freeze": {"schedule": freeze}} if freeze else {})}
    engine = _engine(specs, vocab, schedule, micro, slices, zero, CLIP if clip else 0.0, extra=extra or None)
    if compile_backend is not None:   # as a DeepSpeed user compiles: the layers around each rank's attention call
        engine.compile(backend=compile_backend)
    data = iter(replica_batches(batches, engine.grid.data_parallel_id, micro, dp, STEPS))
    with first_step_grads(engine) as grads:
        losses, _ = train_steps(engine, data, STEPS)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    has_embed = 0 in engine.local_chunks
    g_err, g_name, g_covered = rows_compare(engine, grads, ref["grads"][0], has_embed) if zero == 0 else (0.0, "", [])
    p_err, p_name, p_covered = rows_compare(engine, params, ref["params"], has_embed)
    g_count, p_count = len(g_covered), len(p_covered)
    # (not compiled: an evaluation runs without autograd, which dynamo compiles anew, 6 s a case on 2 cores; the
    # uncompiled cases of the same models check the KV carry, the example trainer a compiled evaluation)
    kv = _kv_heads(engine, batches[:micro]) if compile_backend is None else None
    return {"case": STATUS["case"], "stage": engine.stage_id, "sequence_rank": engine.sequence.rank,
            "slices": list(engine.slices), "source": engine.plan_source, "losses": losses, "ref_losses": ref["losses"],
            "grad_rel_err": g_err, "grad_worst": g_name,
            "param_rel_err": p_err, "param_worst": p_name, "compared": [g_count, p_count],
            "layout": [engine.num_stages, DEGREE, dp], "kv_heads": kv, "compiled": engine.is_compiled}


# bf16, and fp16 with a static scale (no overflow can skip a step and leave the reference behind)
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              "fp16": {"fp16": {"enabled": True, "loss_scale": 1024.0}}}


def _precision_case(precision: str, zero: int, model: str, schedule: str, clip: bool = False) -> dict[str, Any]:
    """Half precision against the fp32 reference: the change of the fp32 master weights over the steps (half
    precision cannot show an update below its rounding) and the losses; the sequence ranks' gradient sum reaches
    each optimizer's own buffers (bf16: its fp32 master gradients; fp16: .grad, loss-scaled). ``clip``: clipped
    by the global norm, which the optimizer computes (bf16 at ZeRO 0: DeepSpeed's, over its model axis)."""
    specs, vocab = _model(model)
    micro = 2
    batches = make_batches(GPTConfig(vocab_size=vocab), STEPS * micro, BATCH, SEQ_LEN, seed=91)
    _, initial, _ = build_spec_layers(_model(model)[0])
    ref_start = {n: p.detach().clone() for n, p in initial.items()}
    ref = frozen_reference(_model(model)[0], batches, STEPS, lambda step: 0, max_norm=CLIP if clip else 0.0)
    engine = _engine(specs, vocab, schedule, micro, UNEQUAL, zero, CLIP if clip else 0.0,
                     precision=PRECISIONS[precision])
    start = master_weights(engine)
    losses = [float(engine.train_batch(iter(batches[s * micro:(s + 1) * micro]))) for s in range(STEPS)]
    update = deltas(master_weights(engine), start)
    err, worst, count = named_compare(update, deltas(ref["params"], ref_start), 0 in engine.local_chunks)
    return {"case": STATUS["case"], "optimizer": type(engine.optimizer).__name__, "losses": losses,
            "ref_losses": ref["losses"], "update_rel_err": err, "update_worst": worst, "compared": count}


def _precision_label(precision: str, zero: int, model: str, schedule: str, clip: bool = False) -> str:
    return f"{precision} zero{zero} sequence model={model} schedule={schedule}" + (" clip" if clip else "")


def _kv_heads(engine: Any, batches: list[tuple]) -> list[int]:
    """The key/value head counts of this rank's KV carry, seen in its attention calls during an evaluation (each
    sequence rank keeps 1/N of them)."""
    from ds_terapipe.runtime.slicing import context

    seen: set[int] = set()
    original = context.MicroBatchState.buffers

    def spy(self: Any, key: Any, like_k: torch.Tensor, like_v: torch.Tensor) -> Any:
        seen.add(int(like_k.shape[1]))
        return original(self, key, like_k, like_v)

    context.MicroBatchState.buffers = spy
    try:
        engine.eval_batch(iter(batches))
    finally:
        context.MicroBatchState.buffers = original
    return sorted(seen)


def _label(model: str, schedule: str, micro: int, slices: Any, zero: int = 0, clip: bool = False,
           vocab_parallel: bool = False, freeze: Optional[list] = None, compile_backend: Optional[str] = None) -> str:
    return (f"sequence model={model} schedule={schedule} m={micro} slices={slices}" +
            (f" zero{zero}" if zero else "") + (" clip" if clip else "") + (" vocab_parallel" if vocab_parallel else "")
            + (f" freeze={freeze}" if freeze else "") + (f" compiled={compile_backend}" if compile_backend else ""))


def _checkpoint(out: Path, precision: str = "fp32", vocab_parallel: bool = False) -> dict[str, Any]:
    """A run saved after 2 steps and resumed in a new engine at the same layout trains the third step exactly
    (bf16 at ZeRO 0: the engine loads DeepSpeed's BF16_Optimizer from each rank's file, the fp32 masters
    included); eval_batch before training reports the first step's loss."""
    STATUS["case"] = f"sequence checkpoint {precision}" + (" vocab_parallel" if vocab_parallel else "")
    extra = {"vocab_parallel": True} if vocab_parallel else None
    specs, vocab = _model("gpt")
    dp = WORLD // (STAGES * DEGREE)
    batches = make_batches(GPTConfig(vocab_size=vocab), 3 * 2 * dp, BATCH, SEQ_LEN, seed=5)
    stream = replica_batches(batches, 0, 2, 1, 3 * dp)
    first = _engine(specs, vocab, "1f1b", 2, UNEQUAL, 0, 0.0, precision=PRECISIONS[precision], extra=extra)
    evaluated = float(first.eval_batch(iter(stream[:2])))   # the sequence ranks' shares summed, as in training
    try:   # each rank holds its share of the logits only: refused on every rank, the engine still usable
        first.eval_batch(iter(stream[:2]), return_logits=True)
        logits_refusal = None
    except ValueError as err:
        logits_refusal = str(err)
    data = iter(stream)
    trained = [float(first.train_batch(data)) for _ in range(2)]
    first.save_checkpoint(str(out))
    uninterrupted = float(first.train_batch(data))
    after = {n: p.detach().clone() for n, p in first.module.named_parameters()}
    masters = master_weights(first)
    again = _engine(specs, vocab, "1f1b", 2, UNEQUAL, 0, 0.0, precision=PRECISIONS[precision], extra=extra)
    again.load_checkpoint(str(out))
    resumed = float(again.train_batch(iter(stream[4:])))
    err = max(rel_err(p.detach(), after[n]) for n, p in again.module.named_parameters())
    err = max(err, max(rel_err(p, masters[n]) for n, p in master_weights(again).items()))
    return {"case": STATUS["case"], "uninterrupted": uninterrupted, "resumed": resumed, "resume_err": err,
            "eval_loss": evaluated, "first_train_loss": trained[0], "logits_refusal": logits_refusal}


def _other_degree(out: Path) -> dict[str, Any]:
    """A checkpoint written at sequence degree 2 (1 replica) resumes at degree 1 (2 replicas), and one written at
    degree 1 resumes at degree 2: the same parameters, and the next step's loss equals the uninterrupted run's (the
    same global batch: one micro-batch per replica where the sequence-parallel run has two)."""
    STATUS["case"] = "sequence checkpoint at another degree"
    specs, vocab = _model("gpt")
    batches = make_batches(GPTConfig(vocab_size=vocab), 3 * 2, BATCH, SEQ_LEN, seed=5)
    out_of: dict[str, Any] = {"case": STATUS["case"]}
    for name, (written, resumed) in (("2to1", (2, 1)), ("1to2", (1, 2))):
        engines = []
        for degree in (written, resumed):
            micro = 2 // (WORLD // (STAGES * degree))   # micro-batches per replica for a global batch of two
            engines.append((_engine(specs, vocab, "1f1b", micro, UNEQUAL, 0, 0.0, degree=degree), micro))

        def steps(engine: Any, micro: int, first: int, count: int) -> list[float]:
            replica = engine.grid.data_parallel_id
            return [float(engine.train_batch(iter(batches[2 * s + replica * micro:2 * s + (replica + 1) * micro])))
                    for s in range(first, first + count)]

        (first, micro), (again, again_micro) = engines
        steps(first, micro, 0, 2)
        first.save_checkpoint(str(out / name))
        uninterrupted = steps(first, micro, 2, 1)[0]
        after = {n: p.detach().clone() for n, p in first.module.named_parameters()}
        again.load_checkpoint(str(out / name))
        out_of[name] = {"uninterrupted": uninterrupted, "resumed": steps(again, again_micro, 2, 1)[0],
                        "resume_err": max(rel_err(p.detach(), after[n]) for n, p in again.module.named_parameters())}
    return out_of


def _replan() -> dict[str, Any]:
    """Online re-planning with sequence ranks: started from a plan of six 8-token slices, the refit after one
    measured step switches (gain threshold 0) on every rank alike, and training stays exact across the switch.
    The planning rank's costs are made 50 ms dearer per action (the refit scales them and keeps that shape), so six
    slices cost far more than fewer whatever this host measures: the points are profiled once each, and a stall in
    a long slice's could make the short slices look cheapest."""
    STATUS["case"] = "sequence replan"
    specs, vocab = _model("gpt")
    dp = WORLD // (STAGES * DEGREE)
    batches = make_batches(GPTConfig(vocab_size=vocab), STEPS * 2 * dp, BATCH, SEQ_LEN, seed=79)
    ref = frozen_reference(_model("gpt")[0], batches, STEPS, lambda step: 0)
    engine = _engine(specs, vocab, "1f1b", 2, "auto", 0, 0.0, extra={
        "replan": {"enabled": True, "warmup_steps": 1, "measure_steps": 1, "min_gain": 0.0}})
    from dataclasses import replace
    cost = copy.deepcopy(engine.plan.cost)
    for stage in [] if cost is None else cost.get("stages", [cost]):   # equal stages: one set of points at the top
        for point in stage["points"]:
            point["forward_ms"] += 50.0
            point["backward_ms"] += 50.0
    engine.install_plan(replace(engine.plan, slices=(8,) * 6, cost=cost))
    data = iter(replica_batches(batches, engine.grid.data_parallel_id, 2, dp, STEPS))
    ran, losses = [], []
    for _ in range(STEPS):
        ran.append(list(engine.slices))
        losses.append(float(engine.train_batch(data)))
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    p_err, p_name, p_count = named_compare(params, ref["params"], 0 in engine.local_chunks)
    decision = engine.replanner.decision
    return {"case": STATUS["case"], "ran": ran, "losses": losses, "ref_losses": ref["losses"], "param_rel_err": p_err,
            "param_worst": p_name, "compared": p_count, "switch": decision["switch"],
            "best": decision["best"]["slices"]}


def _freeze_auto() -> dict[str, Any]:
    """Freezing by the gradient-norm policy with sequence ranks: every rank freezes the same layers at the same
    step (the norms are taken after the sequence sum), and the run equals the reference frozen where it froze."""
    STATUS["case"] = "sequence freeze auto"
    specs, vocab = _model("gpt")
    dp, steps = WORLD // (STAGES * DEGREE), 5
    batches = make_batches(GPTConfig(vocab_size=vocab), steps * 2 * dp, BATCH, SEQ_LEN, seed=83)
    engine = _engine(specs, vocab, "1f1b", 2, UNEQUAL, 0, 0.0, extra={
        "freeze": {"auto": {"check_interval": 1, "tolerance": 100.0, "aggressiveness": 0.34}}})
    data = iter(replica_batches(batches, engine.grid.data_parallel_id, 2, dp, steps))
    losses = [float(engine.train_batch(data)) for _ in range(steps)]
    decided = [(e["step"], e["layers"][1]) for e in engine.freezer.events]
    ref = frozen_reference(_model("gpt")[0], batches, steps,
                           lambda step: max([n for s, n in decided if s <= step] + [0]))
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    p_err, p_name, p_count = named_compare(params, ref["params"], 0 in engine.local_chunks)
    return {"case": STATUS["case"], "decided": decided, "losses": losses, "ref_losses": ref["losses"],
            "param_rel_err": p_err, "param_worst": p_name, "compared": p_count}


def _repack() -> dict[str, Any]:
    """Freezing with a repack under sequence parallelism: once the first stage is frozen whole, 2 stages x 2
    sequence ranks become 1 stage x 2 sequence ranks x 2 replicas in the running job, and training stays equal to
    the reference frozen at the same step."""
    STATUS["case"] = "sequence freeze repack"
    specs, vocab = _model("gpt")
    freeze = [[1, 4]]   # the embedding and three blocks: the first stage's layers
    batches = make_batches(GPTConfig(vocab_size=vocab), STEPS * 2, BATCH, SEQ_LEN, seed=87)
    ref = frozen_reference(_model("gpt")[0], batches, STEPS, _frozen_at(freeze))
    engine = _engine(specs, vocab, "1f1b", 2, UNEQUAL, 0, 0.0,
                     extra={"freeze": {"schedule": freeze, "repack": True}})
    data = iter(batches)
    losses, layouts = [], []
    for _ in range(STEPS):
        losses.append(float(engine.train_batch(data)))
        layouts.append([engine.num_stages, engine.sequence.degree if engine.sequence else 1, engine.dp_world_size])
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    p_err, p_name, p_count = named_compare(params, ref["params"], 0 in engine.local_chunks)
    return {"case": STATUS["case"], "losses": losses, "ref_losses": ref["losses"], "layouts": layouts,
            "param_rel_err": p_err, "param_worst": p_name, "compared": p_count}


def _refusals() -> dict[str, Any]:
    STATUS["case"] = "sequence refusals"
    specs, vocab = _model("gpt")
    out: dict[str, Any] = {}
    for name, kwargs in (("odd_slice", {"slices": [15, 33]}), ):
        try:
            _engine(specs, vocab, "1f1b", 2, kwargs["slices"], 0, 0.0, extra=kwargs.get("extra"),
                    precision=kwargs.get("precision"))
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    # rank 0's assembly of the profiled costs fails (after the others left the gather): every rank raises its
    # error, none waits in the plan's broadcast
    from ds_terapipe.runtime.planning import profile

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("assembling the costs failed (planted)")

    original, profile._assemble = profile._assemble, broken
    try:
        _engine(specs, vocab, "1f1b", 2, "auto", 0, 0.0)
        out["assembly"] = None
    except ValueError as err:
        out["assembly"] = str(err)
    finally:
        profile._assemble = original
    try:   # a module built without the sequence ranks under a config with them
        model = ds_terapipe.TokenPipelineModule(specs, num_stages=WORLD, loss_fn=causal_lm_loss, vocab_size=vocab,
                                                partition_method="uniform")
        ds_terapipe.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={
            "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 2, "train_batch_size": 4,
            "terapipe": {"enabled": True, "seq_len": SEQ_LEN, "slices": 2, "sequence_parallel": DEGREE}})
        out["module"] = None
    except ValueError as err:
        out["module"] = str(err)
    return {"case": STATUS["case"], **out}


def _memory(degree: int) -> dict[str, Any]:
    """This rank's activation memory (bytes of the tensors autograd saves for backward, parameters and the KV carry
    left out, each storage once) and KV-carry memory over one gpipe step of one micro-batch, where every forward
    runs before any backward (so the sums are the peaks); at ``degree`` sequence ranks, the same plan."""
    from ds_terapipe.runtime.slicing import context

    STATUS["case"] = f"sequence memory degree={degree}"
    specs, vocab = _model("gpt")
    engine = _engine(specs, vocab, "gpipe", 1, UNEQUAL, 0, 0.0, degree=degree)
    params = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    kv: dict[int, int] = {}
    saved: dict[int, int] = {}
    original = context.MicroBatchState.buffers

    def spy(self: Any, key: Any, like_k: torch.Tensor, like_v: torch.Tensor) -> Any:
        bufs = original(self, key, like_k, like_v)
        for t in (bufs.k, bufs.v):
            kv[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return bufs

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    batches = make_batches(GPTConfig(vocab_size=vocab), 1, BATCH, SEQ_LEN, seed=3)
    context.MicroBatchState.buffers = spy
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            engine.train_batch(iter(batches))
    finally:
        context.MicroBatchState.buffers = original
    return {"case": STATUS["case"], "stage": engine.stage_id,
            "activation_bytes": sum(n for ptr, n in saved.items() if ptr not in kv), "kv_bytes": sum(kv.values())}


def _fault(shared: Path) -> dict[str, Any]:
    """After a healthy step, the second sequence rank of stage 0 raises in its first block's forward (as an
    out-of-memory would): its sequence peer waits in that block's all-to-all, a collective without a deadline, and
    must stop within seconds (the collective watch), while every rank still lives. The last case of a launch: a
    fault leaves transfers half done."""
    from ds_terapipe.models.gpt import GPTBlock

    STATUS["case"] = "fault"
    timeout_s = 120
    specs, vocab = _model("gpt")
    engine = _engine(specs, vocab, "1f1b", 2, UNEQUAL, 0, 0.0, extra={"p2p_timeout_s": timeout_s})
    dp = WORLD // (STAGES * DEGREE)
    batches = make_batches(GPTConfig(vocab_size=vocab), 2 * 2 * dp, BATCH, SEQ_LEN, seed=5)
    mine = replica_batches(batches, engine.grid.data_parallel_id, 2, dp, 2)
    engine.train_batch(iter(mine[:2]))
    origin = engine.stage_id == 0 and engine.sequence.rank == 1
    if origin:
        def raising(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("simulated out of memory in a sequence-parallel layer")

        next(f for f in engine.module.forward_funcs if isinstance(f, GPTBlock)).forward = raising
    result = run_until_error(lambda: engine.train_batch(iter(mine[2:4])), timeout_s)
    return dict(linger_until_peers_stop(result, shared, timeout_s / 4), origin=origin,
                rank=torch.distributed.get_rank())


class _RaisingWhenProfiledOnRank1(torch.nn.Module):
    """Position-wise; raises on global rank 1 (stage 0's second sequence rank) when called by the profiler."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import inspect

        if torch.distributed.get_rank() == 1 and \
                any(frame.function == "profile_stage" for frame in inspect.stack(context=0)):
            raise RuntimeError("simulated out of memory while profiling a sequence-parallel stage")
        return x


def _init_fault(shared: Path) -> dict[str, Any]:
    """Stage 0's second sequence rank fails while slices "auto" are profiled at init, in a layer before the first
    attention: its sequence peer goes on into that attention's all-to-all, a collective without a deadline, and must
    stop within seconds (the collective watch), while every rank still lives."""
    from deepspeed.pipe import LayerSpec

    STATUS["case"] = "fault"
    timeout_s = 120
    specs, vocab = _model("gpt")
    specs.insert(1, LayerSpec(_RaisingWhenProfiledOnRank1))
    result = run_until_error(lambda: _engine(specs, vocab, "1f1b", 2, "auto", 0, 0.0,
                                             extra={"p2p_timeout_s": timeout_s}), timeout_s)
    return dict(linger_until_peers_stop(result, shared, timeout_s / 4), origin=torch.distributed.get_rank() == 1,
                rank=torch.distributed.get_rank())


@suite("sequence")
def suite_sequence(extra: dict) -> list[dict]:
    allow_fp16_on_cpu()
    if extra.get("init_fault"):   # a launch of its own: a fault ends the launch
        return [_init_fault(Path(extra["out"]) / "init_fault")]
    results = run_cases([tuple(c) for c in extra.get("cases", [])], _label, _case)
    results += run_cases([tuple(c) for c in extra.get("precision_cases", [])], _precision_label, _precision_case)
    # packed rows (tests/suites/packed.py's cases, at sequence degree 2): [schedule, v, slices, precision, 2]
    results += run_cases([tuple(c) for c in extra.get("packed_cases", [])], packed_suite._label, packed_suite._case)
    if extra.get("features"):
        results.append(_checkpoint(Path(extra["out"]) / "sequence_ckpt"))
        results.append(_checkpoint(Path(extra["out"]) / "sequence_ckpt_bf16", "bf16"))
        results.append(_checkpoint(Path(extra["out"]) / "sequence_ckpt_vocab", vocab_parallel=True))
        results.append(_other_degree(Path(extra["out"]) / "sequence_ckpt_degree"))
        results.append(_replan())
        results.append(_freeze_auto())
        results.append(_repack())
        results.append(_refusals())
        results += [_memory(1), _memory(DEGREE)]
    if extra.get("fault"):
        results.append(_fault(Path(extra["out"]) / "fault"))
    return results
