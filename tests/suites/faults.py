"""Suite ``faults`` (3 ranks: a middle stage waits on peers that are not the failing one), asserted on by
tests/test_engine_faults.py: the init-time slice check refusing attention that mixes tokens wrongly when sliced
(hidden from the outputs by a zero-initialised projection; also checked on the first batch where no input can be
sampled), a planner failure raised on every rank, a constant KV-cache key and one block shared at three depths
trained exactly; then ONE fault, ``extra["fault"]`` ("loss", "length", "init", "profile", "profile last",
"profile reduce", "checkpoint", "deepspeed save", "deepspeed load", "repack" or "optimizer"): a fault leaves
transfers half done, so it ends the launch, and every rank must stop within seconds, naming it.
``extra["cases"]=False`` runs the fault alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

import ds_terapipe
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from ds_terapipe.models.gpt import GPTBlock, GPTConfig, causal_lm_loss, gpt_layer_specs
from tests.suites import suite
from tests.suites.common import (RANK, STATUS, build_spec_layers, first_step_grads, linger_until_peers_stop,
                                 make_batches, pipeline_engine, rel_err, run_until_error)


class ZeroProjMixer(torch.nn.Module):
    """Residual attention with a zero-initialised output projection that mixes tokens wrongly when sliced:
    ``"bidirectional"`` (no mask) or ``"slice-blind"`` (causal over the running slice alone). Its outputs equal
    its inputs at init, so only gradients show the mixing."""

    def __init__(self, cfg: GPTConfig, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.qkv = torch.nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = torch.nn.Linear(cfg.hidden, cfg.hidden)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=3)  # (B, 1, T, C)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.mode == "slice-blind")
        return x + self.proj(y.squeeze(1))


class ConstantKeyBlock(GPTBlock):
    """A GPT block whose attention passes one constant cache_key (the same for every block of the model)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.attn
        batch, tokens, channels = x.shape
        q, k, v = (t.view(batch, tokens, attn.num_heads, -1).transpose(1, 2)
                   for t in attn.qkv(self.ln_1(x)).split(channels, dim=2))  # (B, nh, T, hs)
        y = ds_terapipe.sliced_causal_attention(q, k, v, cache_key="attention")
        x = x + attn.proj(y.transpose(1, 2).reshape(batch, tokens, channels))
        return x + self.fc_out(torch.nn.functional.gelu(self.fc_in(self.ln_2(x))))


def shared_block_specs(cfg: GPTConfig) -> list:
    """Weight sharing: one block (TiedLayerSpec "shared") at three depths, twice on the middle stage of 3."""
    names = [n for n, _ in GPTBlock(cfg, 0).named_parameters()]
    shared = TiedLayerSpec("shared", GPTBlock, cfg, 7, tied_weight_attr=names)
    specs = gpt_layer_specs(cfg)  # embed, block 0, block 1, final norm, head
    return [specs[0], specs[1], shared, shared, specs[2], shared, specs[-2], specs[-1]]


def spec_reference_grads(specs: list, batches: list[tuple]) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process, unsliced: build the layer specs once (a TiedLayerSpec key once), apply them in order;
    return the mean loss and every gradient under the pipeline module's parameter names."""
    steps, named, _ = build_spec_layers(specs)
    total = 0.0
    for x, y in batches:
        for step in steps:
            x = step(x)
        loss = causal_lm_loss(x, y) / len(batches)
        loss.backward()
        total += float(loss)
    return total, {n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None}


# every fault case's deadline: a peer stopped by the abort flag must raise long before it
FAULT_P2P_TIMEOUT_S = 120


@suite("faults")
def suite_faults(extra: dict) -> list[dict]:
    """Slice-check refusals, shared KV keys and weight-shared blocks trained exactly, then ONE fault (a fault
    leaves transfers half done, so it ends the launch): ``extra["fault"]`` is "loss" or "length"."""
    cfg = GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=13)
    seq_len, batch, micro = 48, 2, 2
    batches = make_batches(cfg, micro, batch, seq_len, seed=21)
    results: list[dict] = []

    def until_error(run: Callable[[], Any]) -> dict[str, Any]:
        return run_until_error(run, FAULT_P2P_TIMEOUT_S)

    if extra.get("cases", True):
        # a zero-initialised output projection hides a wrong attention from the outputs: refused at init, also
        # where the last stage alone holds it (its rank's verdict reaches every rank)
        for name, mode, last in (("bidirectional", "bidirectional", False), ("slice-blind", "slice-blind", False),
                                 ("bidirectional, last stage", "bidirectional", True)):
            STATUS["case"] = f"refusal {name}"
            layers = gpt_layer_specs(cfg)
            layers.insert(len(layers) - 1 if last else 1, LayerSpec(ZeroProjMixer, cfg, mode))
            try:
                pipeline_engine(cfg, layers, {"seq_len": seq_len, "slices": 4, "schedule": "gpipe",
                                              "granularity": 4})
                results.append({"case": STATUS["case"], "raised": None})
            except Exception as err:  # noqa: BLE001 - the test checks the type name
                results.append({"case": STATUS["case"], "raised": type(err).__name__, "message": str(err)})

        # the same wrong attention in a model that cannot sample an input (no vocab_size, no input_sampler):
        # nothing to probe at init, so the check runs on the first real batch, before the first step
        STATUS["case"] = "refusal bidirectional, no sampler"
        layers = gpt_layer_specs(cfg)
        layers.insert(1, LayerSpec(ZeroProjMixer, cfg, "bidirectional"))
        engine = pipeline_engine(cfg, layers, {"seq_len": seq_len, "slices": 4, "schedule": "gpipe",
                                               "granularity": 4}, sampler=False)
        before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
        try:
            engine.train_batch(iter(batches))
            results.append({"case": STATUS["case"], "raised": None})
        except Exception as err:  # noqa: BLE001 - the test checks the type name
            results.append({"case": STATUS["case"], "raised": type(err).__name__, "message": str(err),
                            "trained": any(not torch.equal(p, before[name])
                                           for name, p in engine.module.named_parameters())})

        # the planner fails on global rank 0 (no slicing fits the memory limit): every rank raises it together,
        # none waits for rank 0's decision (no fault: the process group stays usable)
        STATUS["case"] = "planner failure"
        results.append(until_error(lambda: pipeline_engine(cfg, gpt_layer_specs(cfg), {
            "seq_len": seq_len, "slices": "auto", "granularity": 4, "memory_limit_gb": 1e-9,
            "p2p_timeout_s": FAULT_P2P_TIMEOUT_S,
            "profile": {"slice_lengths": [8, 48], "num_contexts": 1, "warmup": 0, "repeats": 1}})))

        # two layers with one constant cache_key, and one block at three depths: trained exactly
        deep = GPTConfig(**{**cfg.to_dict(), "num_layers": 4})  # 7 layers on 3 stages: 2+ blocks on a stage
        models = {"constant key": [spec if not (isinstance(spec, LayerSpec) and spec.typename is GPTBlock)
                                   else LayerSpec(ConstantKeyBlock, *spec.module_args)
                                   for spec in gpt_layer_specs(deep)],
                  "shared block": shared_block_specs(cfg)}
        for label, specs in models.items():
            ref_loss, ref_grads = spec_reference_grads(specs, batches)
            for sched in ("gpipe", "1f1b", "gpipe+W", "1f1b+W"):
                STATUS["case"] = f"{label} {sched}"
                # the constant-key model also runs a list of slices off the granularity (accepted, exact)
                slices = [5, 27, 16] if label == "constant key" else [8, 24, 16]
                engine = pipeline_engine(deep, specs, {"seq_len": seq_len, "slices": slices, "granularity": 4,
                                                       "schedule": sched.removesuffix("+W"),
                                                       "deferred_weight_grads": sched.endswith("+W")},
                                         micro=micro, batch=batch)
                with first_step_grads(engine) as grads:
                    loss = float(engine.train_batch(iter(batches)))
                errs = {n: rel_err(g, ref_grads[n]) for n, g in grads.items()
                        if not (n == "tied_modules.embed.wpe.weight" and engine.stage_id != 0)}
                worst = max(errs, key=errs.get)
                # blocks this stage runs (a shared block counted once per depth): 2+ share a key or a module
                blocks = sum(isinstance(f, GPTBlock) for f in engine.module.forward_funcs)
                results.append({"case": STATUS["case"], "loss": loss, "ref_loss": ref_loss, "grad_rel_err": errs[worst],
                                "grad_worst": worst, "covered": sorted(errs), "ref_names": sorted(ref_grads),
                                "blocks": blocks})

    fault = extra.get("fault")
    if fault == "loss":
        # a loss function that raises on the last stage: every rank stops within seconds, naming it
        STATUS["case"] = "raising loss"

        def raising_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("simulated loss failure")

        engine = pipeline_engine(cfg, gpt_layer_specs(cfg), {"seq_len": seq_len, "slices": 3, "schedule": "1f1b",
                                                             "granularity": 4, "p2p_timeout_s": FAULT_P2P_TIMEOUT_S},
                                 loss_fn=raising_loss)
        results.append(until_error(lambda: engine.train_batch(iter(batches))))
    elif fault == "length":
        # the data runs out after micro-batch 0 of a 2-micro-batch step: the reading stages see it before the
        # step starts, and every rank (the middle stage too) stops there, together
        STATUS["case"] = "short iterator"
        engine = pipeline_engine(cfg, gpt_layer_specs(cfg), {"seq_len": seq_len, "slices": 3, "schedule": "gpipe",
                                                             "granularity": 4, "p2p_timeout_s": FAULT_P2P_TIMEOUT_S})
        results.append(until_error(lambda: engine.train_batch(iter(batches[:1]))))
    elif fault == "init":
        # a layer on the middle stage that raises in the sliced run of the init-time check, after the probe pass:
        # its peers wait for its verdict and stop within seconds, naming it
        STATUS["case"] = "init"
        layers = gpt_layer_specs(cfg)
        layers.insert(2, LayerSpec(RaisingWhenSliced))  # embed, block 0 | raising, block 1 | norm, head
        results.append(until_error(lambda: pipeline_engine(cfg, layers, {
            "seq_len": seq_len, "slices": 3, "granularity": 4, "p2p_timeout_s": FAULT_P2P_TIMEOUT_S})))
    elif fault in ("profile", "profile last"):
        # a layer that raises while slices "auto" are profiled (after the init-time check passed), on the middle
        # stage or on the last, whose head is tied to the first stage's embedding: its peers, about to time the
        # tied and data-parallel reductions and to gather the measured costs, stop within seconds, naming it
        STATUS["case"] = fault
        layers = gpt_layer_specs(cfg)
        # embed, block 0 | raising, block 1 | norm, head; or embed, block 0 | block 1, norm | raising, head
        layers.insert(2 if fault == "profile" else len(layers) - 1, LayerSpec(RaisingWhenProfiled))
        results.append(until_error(lambda: pipeline_engine(cfg, layers, {
            "seq_len": seq_len, "slices": "auto", "granularity": 4, "p2p_timeout_s": FAULT_P2P_TIMEOUT_S,
            "profile": {"slice_lengths": [8, 48], "num_contexts": 1, "warmup": 0, "repeats": 1}})))
    elif fault == "profile reduce":
        # rank 0 fails right after the barrier before the timed reductions (allocating the tied weight's buffer, as
        # an out-of-memory would): its tied peer waits in the timed all-reduce, which cannot watch the flag, and
        # stops through the collective watch over init's planning (the middle stage, in a barrier, by the flag)
        STATUS["case"] = fault
        from ds_terapipe.runtime.planning import step_profile

        if RANK == 0:
            def raising(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("simulated out of memory allocating the tied reduction's buffer")

            step_profile._time_tied_reduce = raising
        result = until_error(lambda: pipeline_engine(cfg, gpt_layer_specs(cfg), {
            "seq_len": seq_len, "slices": "auto", "granularity": 4, "p2p_timeout_s": FAULT_P2P_TIMEOUT_S,
            "profile": {"slice_lengths": [8, 48], "num_contexts": 1, "warmup": 0, "repeats": 1}}))
        results.append(linger_until_peers_stop(result, Path(extra["out"]), FAULT_P2P_TIMEOUT_S / 4))
    elif fault == "checkpoint":
        # one rank fails while saving (here: its plan summary raises); the others stop within seconds
        STATUS["case"] = "checkpoint"
        results.append(_one_rank_breaks(cfg, batches, seq_len, 1, lambda e: e, "plan_summary",
                                        OSError("simulated disk failure"),
                                        lambda e: e.save_checkpoint(str(Path(extra["out"]) / "ckpt"))))
    elif fault == "deepspeed save":
        # rank 0 fails inside DeepSpeed's own save (creating the directory) while its peers wait in that save's
        # barrier, which cannot watch the flag
        STATUS["case"] = "deepspeed save"
        results.append(_one_rank_breaks(cfg, batches, seq_len, 0, lambda e: e.checkpoint_engine, "makedirs",
                                        OSError("simulated disk failure in DeepSpeed's save"),
                                        lambda e: e.save_checkpoint(str(Path(extra["out"]) / "ckpt")),
                                        stays_alive=Path(extra["out"])))
    elif fault == "deepspeed load":
        # the middle stage fails inside DeepSpeed's load of a checkpoint every rank just saved (reading its layers'
        # files, as a file it alone cannot read would): its peers, whose loads succeeded, stop at the end of theirs
        # rather than go on without it into the collectives after the load (the checkpoint's plan, the freezer)
        STATUS["case"] = "deepspeed load"
        ckpt_dir = str(Path(extra["out"]) / "ckpt_load")
        results.append(_one_rank_breaks(cfg, batches, seq_len, 1, lambda e: e, "load_module_state_dict",
                                        OSError("simulated unreadable layer file in DeepSpeed's load"),
                                        lambda e: (e.save_checkpoint(ckpt_dir), e.load_checkpoint(ckpt_dir))))
    elif fault == "repack":
        # the first stage's layers freeze at step 1 and the pipeline repacks onto 1 stage x 3 replicas; the middle
        # stage fails building the repacked engine (as an out-of-memory would) while its peers are inside
        # DeepSpeed's broadcasts of that build, which cannot watch the flag
        STATUS["case"] = "repack"
        three = make_batches(cfg, 3, batch, seq_len, seed=21)   # 3 micro-batches: one per replica after it
        results.append(_one_rank_breaks(cfg, three, seq_len, 1, type, "build",
                                        RuntimeError("simulated out of memory building the repacked engine"),
                                        lambda e: e.train_batch(iter(three)), micro=3,
                                        terapipe={"freeze": {"schedule": [[1, 2]], "repack": True}},
                                        stays_alive=Path(extra["out"])))
    elif fault == "optimizer":
        # the middle stage raises in its optimizer step (as an out-of-memory would) before the gradient norm's
        # all-reduce: its peers are inside that all-reduce (DeepSpeed's _take_model_step), which it never joins
        STATUS["case"] = "optimizer"
        results.append(_one_rank_breaks(cfg, batches, seq_len, 1, lambda e: e, "clip_fp32_gradients",
                                        RuntimeError("simulated out of memory in the optimizer step"),
                                        lambda e: e.train_batch(iter(batches)),
                                        extra_config={"gradient_clipping": 1.0}, stays_alive=Path(extra["out"])))
    return results


def _one_rank_breaks(cfg: GPTConfig, batches: list[tuple], seq_len: int, origin: int, owner: Callable[[Any], Any],
                     attr: str, error: Exception, run: Callable[[Any], Any], extra_config: dict | None = None,
                     stays_alive: Path | None = None, micro: int = 2, terapipe: dict | None = None
                     ) -> dict[str, Any]:
    """An engine trained one step (``micro`` micro-batches, ``terapipe`` added to its section), whose rank
    ``origin`` gets ``attr`` of ``owner(engine)`` replaced by a function raising ``error``; then ``run(engine)``
    on every rank until it raises. ``stays_alive`` (a shared directory): every rank lives on after raising until
    all have (:func:`~tests.suites.common.linger_until_peers_stop`, at most a quarter of ``p2p_timeout_s``)."""
    engine = pipeline_engine(cfg, gpt_layer_specs(cfg), {"seq_len": seq_len, "slices": 3, "granularity": 4,
                                                         "p2p_timeout_s": FAULT_P2P_TIMEOUT_S, **(terapipe or {})},
                             extra_config=extra_config, micro=micro)
    engine.train_batch(iter(batches))
    if RANK == origin:
        def raising(*args: Any, **kwargs: Any) -> Any:
            raise error

        setattr(owner(engine), attr, raising)
    result = run_until_error(lambda: run(engine), FAULT_P2P_TIMEOUT_S)
    if stays_alive is not None:
        result = linger_until_peers_stop(result, stays_alive, FAULT_P2P_TIMEOUT_S / 4)
    return result


class RaisingWhenSliced(torch.nn.Module):
    """Position-wise when unsliced; raises inside a sliced forward (a bug that shows only under slicing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ds_terapipe.runtime.slicing.context import current_slice

        if current_slice() is not None:
            raise RuntimeError("simulated layer failure under slicing")
        return x


class RaisingWhenProfiled(torch.nn.Module):
    """Position-wise; raises when called by the profiler (``runtime/planning/profile.py``), after the slice check
    passed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import inspect

        if any(frame.function == "profile_stage" for frame in inspect.stack(context=0)):
            raise RuntimeError("simulated layer failure while profiling")
        return x
