"""Model and device presets, so a plan can be made before any hardware is profiled.

Models are the GPT-3 settings of the TeraPipe paper (ICML 2021, Table 1): 1B (24 layers, hidden 2048),
13B (40, 5120), 44B (96, 6144), 175B (96, 12288), all with 128-wide heads (num_heads = hidden / 128),
the GPT-2 vocabulary (50257) and 2048-token sequences.

Devices are kernel-level roofline parameters (``DeviceSpec``, physics in ``roofline.py``): every kernel costs the
longest of its FLOPs at ``peak * efficiency``, its bytes at ``bandwidth * bandwidth_efficiency`` (GEMMs read
their weights whole, so a short slice costs a read of the weights) and a launch floor; small ops stream at
``stream_efficiency`` of the bandwidth; attention runs at ``attention_efficiency`` of peak. Peaks and bandwidths
are the vendor data sheets' dense 16-bit figures (V100 SXM2 125 TFLOPS / 900 GB/s, A100 SXM 312 / 1555 (40 GB),
H100 SXM 989 / 3350, H200 989 / 4800); ``cpu`` is a modest fp32 server socket (0.2 TFLOPS, 20 GB/s, a fixed cost
per layer and no launch floor).

``h100`` is calibrated on one H100 80GB HBM3 (torch 2.11, bf16, batch 1; ``data/h100_measured.json``): Llama-3-8B,
GPT-3-13B, Llama-70B and GPT-3-175B-shaped layers, one sequence cut into 1 to 32 slices. Its fractions were chosen
on a grid to minimise the worst relative error of the predicted per-slice forward, backward and weight-gradient
times (``tests/test_presets.py`` holds the preset to 20%): GEMMs reach 0.75 of peak when compute-bound and 0.8 of
the bandwidth when bound by their weight; streaming ops 0.9; flash attention 0.3 of peak (a profile of the flash
kernels on the same GPU measured 0.29-0.32). The launch floors are the host's: 24 us per op dispatched from
Python (forwards, a deferred W pass), 12 us per op the autograd engine runs (backwards); with the counted ops of a
block (``roofline.BLOCKS``) they are what a slice of a few hundred tokens pays besides its weight reads. ``a100``
and ``v100`` are not calibrated: they keep their data-sheet peaks and bandwidths and their earlier GEMM
efficiencies (0.55, 0.5), read weights at the full bandwidth, and take a launch floor of their earlier per-layer
overhead spread over a block's ~15 kernels (5.3 and 6.7 us); attention and streaming ops run at those same
efficiencies. ``h200`` is the H100's chip with faster memory: ``h100``'s fractions and floors at the H200's
data-sheet bandwidth, not fitted again. It predicts one H200's micro-batches of a GPT-3-175B-shaped and a
Llama-70B-shaped layer in 1-16 slices, deferred and not, within 12% (``benchmarks/results/gpu_slices.json``,
``tests/test_presets.py``).

The model presets attend over every earlier token. ``resolve_model(..., window=w)`` gives their layers a sliding
window of w keys (Mistral's attention), and with ``full_every=k`` every k-th layer keeps full attention (Gemma 2:
k = 2, Gemma 3 and Cohere 2: 6 and 4, as ``transformers``' ``sliding_window_pattern``); a ``TransformerSpec`` of
your own takes any per-layer windows (``window``: one entry per layer). ``resolve_model(..., attention_chunk=C)``
gives them chunked attention of C tokens instead (Llama 4's local layers; ``full_every=4`` as Llama 4). The costs
are per layer: a stage's attention adds up its own layers' windows.

Links are the stage-to-stage network a pipeline crossing nodes sees: V100 100 Gbit/s (AWS p3dn), A100 200 Gbit/s
(HDR InfiniBand), H100 400 Gbit/s (NDR), CPU 10 Gbit/s Ethernet. These are estimates for ranking plans; profile
(``MeasuredCost``) when the numbers matter.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from ._checks import check_int
from .cost import AnalyticCost, DeviceSpec, PipelineCost, TransformerSpec
from .roofline import Chunked, Windows

if TYPE_CHECKING:
    from .slicing import MemoryModel

logger = logging.getLogger(__name__)

__all__ = [
    "MODEL_PRESETS",
    "DEVICE_PRESETS",
    "get_model_preset",
    "get_device_preset",
    "split_layers",
    "sliding_windows",
    "chunked_layers",
    "analytic_pipeline_cost",
    "analytic_layer_costs",
    "resolve_model",
    "preset_memory_model",
]


def _gpt3(num_layers: int, hidden: int) -> TransformerSpec:
    return TransformerSpec(num_layers=num_layers, hidden=hidden, num_heads=hidden // 128, vocab=50257,
                           seq_len=2048)


MODEL_PRESETS: dict[str, TransformerSpec] = {
    "gpt3-1b": _gpt3(24, 2048),
    "gpt3-13b": _gpt3(40, 5120),
    "gpt3-44b": _gpt3(96, 6144),
    "gpt3-175b": _gpt3(96, 12288),
}

DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "v100": DeviceSpec("v100", peak_tflops=125.0, mem_bw_gbps=900.0, per_layer_overhead_ms=0.0, efficiency=0.5,
                       link_gbps=100.0, link_latency_ms=0.02, kernel_launch_ms=0.0067),
    "a100": DeviceSpec("a100", peak_tflops=312.0, mem_bw_gbps=1555.0, per_layer_overhead_ms=0.0, efficiency=0.55,
                       link_gbps=200.0, link_latency_ms=0.01, kernel_launch_ms=0.0053),
    "h100": DeviceSpec("h100", peak_tflops=989.0, mem_bw_gbps=3350.0, per_layer_overhead_ms=0.0, efficiency=0.75,
                       link_gbps=400.0, link_latency_ms=0.01, bandwidth_efficiency=0.8, stream_efficiency=0.9,
                       attention_efficiency=0.3, kernel_launch_ms=0.024, backward_launch_ms=0.012),
    # H100's fractions at the H200's data-sheet bandwidth (same chip, faster memory); checked, not fitted
    "h200": DeviceSpec("h200", peak_tflops=989.0, mem_bw_gbps=4800.0, per_layer_overhead_ms=0.0, efficiency=0.75,
                       link_gbps=400.0, link_latency_ms=0.01, bandwidth_efficiency=0.8, stream_efficiency=0.9,
                       attention_efficiency=0.3, kernel_launch_ms=0.024, backward_launch_ms=0.012),
    "cpu": DeviceSpec("cpu", peak_tflops=0.2, mem_bw_gbps=20.0, per_layer_overhead_ms=0.02,
                      efficiency=0.6, link_gbps=10.0, link_latency_ms=0.05),
}


def get_model_preset(name: str) -> TransformerSpec:
    """The model preset called ``name`` (case-insensitive)."""
    key = str(name).lower()
    if key not in MODEL_PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; valid names: {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[key]


def get_device_preset(name: str) -> DeviceSpec:
    """The device preset called ``name`` (case-insensitive)."""
    key = str(name).lower()
    if key not in DEVICE_PRESETS:
        raise ValueError(f"device preset {name!r} is unknown; valid names: {', '.join(DEVICE_PRESETS)}")
    return DEVICE_PRESETS[key]


def split_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible, the remainder going to the first stages (the last stage also
    carries the LM head, so it should not get an extra layer too)."""
    num_layers = check_int(num_layers, "num_layers", minimum=1, wrong_type=ValueError)
    num_stages = check_int(num_stages, "num_stages", minimum=1, wrong_type=ValueError)
    if num_stages > num_layers:
        raise ValueError(f"num_stages = {num_stages} exceeds the model's {num_layers} layers; use at most "
                         f"{num_layers} stages")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def _full_every(num_layers: int, attention: Windows, full_every: int | None, example: str, others: str) -> Windows:
    """``attention`` on every layer (``full_every`` None), or full attention on every k-th layer (layer i when
    (i + 1) % k == 0) and ``attention`` on the others."""
    if full_every is None:
        return attention
    k = check_int(full_every, "full_every", fix=f"give k for full attention on every k-th layer ({example}), or "
                  f"None for {others} on every layer", wrong_type=ValueError)
    return tuple(None if (i + 1) % k == 0 else attention for i in range(num_layers))


def sliding_windows(num_layers: int, window: int, full_every: int | None = None) -> Windows:
    """``TransformerSpec.window`` for ``num_layers`` layers with a sliding ``window``: every layer's (``full_every``
    None), or, as ``transformers``' ``sliding_window_pattern`` k of Gemma 2/3 and Cohere 2, full attention on every
    k-th layer (layer i when (i + 1) % k == 0) and the window on the others."""
    window = check_int(window, "window", fix="give the sliding window in keys (Mistral: 4096)", wrong_type=ValueError)
    return _full_every(num_layers, window, full_every, "Gemma 2: 2", "the window")


def chunked_layers(num_layers: int, attention_chunk: int, full_every: int | None = None) -> Windows:
    """``TransformerSpec.window`` for ``num_layers`` layers of chunked attention of ``attention_chunk`` tokens (not the
    pipeline's chunks of layers): every layer's (``full_every`` None), or, as Llama 4 (k = 4: its layers without
    rotary attend fully), full attention on every k-th layer and the chunks on the others."""
    chunk = check_int(attention_chunk, "attention_chunk", fix="give the tokens of an attention chunk (Llama 4: 8192)",
                      wrong_type=ValueError)
    return _full_every(num_layers, Chunked(chunk), full_every, "Llama 4: 4", "the chunks")


def resolve_model(model: str | TransformerSpec, vocab: int | None = None, *, window: int | None = None,
                  full_every: int | None = None, attention_chunk: int | None = None) -> TransformerSpec:
    """A preset by name (or a spec as is), with its vocabulary replaced by ``vocab`` when given (e.g. a 256k
    tokenizer on a GPT-3 body: the LM head and embedding grow, the blocks do not), and with ``window`` its layers'
    sliding windows (``sliding_windows``: on every layer, or with ``full_every`` k full attention on every k-th),
    or with ``attention_chunk`` chunked attention the same way (``chunked_layers``)."""
    spec = get_model_preset(model) if isinstance(model, str) else model
    if vocab is not None:
        spec = dataclasses.replace(spec, vocab=check_int(vocab, "vocab", fix="pass the tokenizer's vocabulary size"))
    if window is not None and attention_chunk is not None:
        raise ValueError(f"window = {window!r} and attention_chunk = {attention_chunk!r}: a layer attends within a "
                         "sliding window or within chunks; pass one of them")
    if window is not None:
        spec = dataclasses.replace(spec, window=sliding_windows(spec.num_layers, window, full_every))
    elif attention_chunk is not None:
        spec = dataclasses.replace(spec, window=chunked_layers(spec.num_layers, attention_chunk, full_every))
    elif full_every is not None:
        raise ValueError(f"full_every = {full_every!r} picks the layers of full attention among windowed (or "
                         "chunked) ones, but neither is given; pass window=W or attention_chunk=C too")
    return spec


def analytic_pipeline_cost(model: str | TransformerSpec, device: str | DeviceSpec, num_stages: int, *,
                           bytes_per_element: int = 2, lm_head: bool = True, embedding: bool | None = None,
                           vocab: int | None = None, deferred_weight_grads: bool = False) -> PipelineCost:
    """Roofline cost of ``model`` split over ``num_stages`` equal ``device``s.

    Blocks are split by ``split_layers`` (the naive layout; ``planner.partition`` balances it). With ``lm_head``
    (default) the last stage also pays the vocabulary projection and softmax, and with ``embedding`` (default:
    as ``lm_head``) the first stage pays the input embedding (its dense per-slice gradient), which is what real
    GPT pipelines do and makes the stages unequal (the planner then scores its candidates with the simulator);
    ``lm_head=False`` ignores both and, when the layers divide evenly, gives equal stages. ``vocab`` replaces
    the model's vocabulary. ``deferred_weight_grads``: the stages' backward leaves the Linears' weight gradients
    to ``W`` actions (``AnalyticCost.weight_ms``), and the cost's ``has_weight_terms`` says so to the planner.
    """
    spec = resolve_model(model, vocab)
    dev = get_device_preset(device) if isinstance(device, str) else device
    embedding = lm_head if embedding is None else bool(embedding)
    layers = split_layers(spec.num_layers, num_stages)
    firsts = [sum(layers[:s]) for s in range(num_stages)]
    cache: dict[tuple, AnalyticCost] = {}  # share objects so equal stages are recognised cheaply
    stages = []
    for s, (first, n) in enumerate(zip(firsts, layers)):
        key = (spec.window_counts(first, n), lm_head and s == num_stages - 1, embedding and s == 0)
        if key not in cache:
            cache[key] = AnalyticCost(spec, dev, n, bytes_per_element=bytes_per_element, lm_head=key[1],
                                      embedding=key[2], deferred_weight_grads=deferred_weight_grads,
                                      first_layer=first)
        stages.append(cache[key])
    return PipelineCost(stages, meta={"model": repr(spec), "device": dev.name, "layers": layers,
                                      "lm_head": lm_head, "embedding": embedding,
                                      "deferred_weight_grads": bool(deferred_weight_grads)})


def analytic_layer_costs(model: str | TransformerSpec, device: str | DeviceSpec, *, bytes_per_element: int = 2,
                         vocab: int | None = None) -> list[AnalyticCost]:
    """One cost per layer, in model order: the input embedding, ``num_layers`` blocks (one shared object per
    window), the LM head (projection + softmax): what ``planner.partition`` cuts into stages."""
    spec = resolve_model(model, vocab)
    dev = get_device_preset(device) if isinstance(device, str) else device
    blocks: dict[int | None, AnalyticCost] = {}
    for i, window in enumerate(spec.layer_windows):
        if window not in blocks:
            blocks[window] = AnalyticCost(spec, dev, 1, bytes_per_element=bytes_per_element, first_layer=i)
    return [AnalyticCost(spec, dev, 0, bytes_per_element=bytes_per_element, embedding=True),
            *[blocks[w] for w in spec.layer_windows],
            AnalyticCost(spec, dev, 0, bytes_per_element=bytes_per_element, lm_head=True)]


def preset_memory_model(model: str | TransformerSpec, num_stages: int, *, bytes_per_element: int = 2,
                        activation_factor: float = 34.0) -> MemoryModel:
    """The ``MemoryModel`` matching ``analytic_pipeline_cost``'s layer split, for ``plan_slicing(memory=...)``."""
    from .slicing import MemoryModel

    spec = get_model_preset(model) if isinstance(model, str) else model
    return MemoryModel(tuple(split_layers(spec.num_layers, num_stages)), spec.hidden, bytes_per_element,
                       activation_factor)
