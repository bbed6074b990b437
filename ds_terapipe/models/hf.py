"""Hugging Face decoder-only causal LMs (Llama, Gemma, Qwen, Phi, GPT-NeoX, ...) as token-pipeline LayerSpecs.

    from transformers import LlamaConfig
    from ds_terapipe.models.hf import causal_lm_specs, causal_lm_loss
    config = LlamaConfig(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2)
    model = TokenPipelineModule(causal_lm_specs(config), num_stages=2, loss_fn=causal_lm_loss,
                                vocab_size=config.vocab_size)

The decoder layers are ``transformers``' own classes, unmodified. Only the attention function differs: the specs
set ``config._attn_implementation = "ds_terapipe"``, a function registered in ``transformers``'
``AttentionInterface`` that hands q/k/v to :func:`~ds_terapipe.sliced_causal_attention` with the attention
module as cache key, so each slice attends over its micro-batch's cached prefix. Rotary positions are
``token_offset() + arange(slice_len)``, computed by the model's own rotary module in each decoder layer's
wrapper. Grouped-query attention keeps the cache at ``num_key_value_heads``: k/v go to
:func:`~ds_terapipe.sliced_causal_attention` with their own head count, and SDPA pairs the heads (``enable_gqa``). The
pipeline layers are: embedding, the decoder layers, the final norm, the LM head (a ``TiedLayerSpec`` with the embedding
when the weights are tied); the loss is :func:`causal_lm_loss`. What an architecture's ``*Model`` / ``*ForCausalLM``
does around its layers is redone here from the ``_FAMILIES`` table: the embedding's scale (Gemma's sqrt(hidden),
Granite's multiplier) or norm (NanoChat) and dropout, the final norm's class (by the config for Cohere 2-MoE) and
bias (none in DBRX's), the head's bias, logit scale (Granite, Cohere, HyperCLOVA X) and final-logit softcapping
(Gemma 2/3), per-layer-type rotary tables (Gemma 3, OLMo 3), a rotary base per layer and layers without rotary
(Granite SWA, Cohere Compass), and each layer's sliding window: the one the model's own mask gives that layer
(``sliding_window`` on every layer of Mistral, Mixtral, Phi-3, ...; on the ``'sliding_attention'`` layers of
``layer_types`` in Gemma 2/3, Qwen, OLMo 3, Cohere 2, ...), handed to :func:`~ds_terapipe.sliced_causal_attention` as
``window``, and Llama 4's chunk (``attention_chunk_size`` on the ``'chunked_attention'`` layers) as ``chunk``.
Attention-logit softcapping (Gemma 2's ``attn_logit_softcapping``) goes to it as ``softcap``, and attention sinks
(the ``s_aux`` gpt-oss', Granite SWA's and MiMo-V2-Flash's attention passes) as ``sinks``. Latent attention (DeepSeek,
Youtu, MiniCPM3, ...) hands over keys wider than its values (``qk_nope_head_dim + qk_rope_head_dim`` vs
``v_head_dim``), which the sliced attention and its KV buffers take as they are.

Features whose result would depend on the slicing, or that the token pipeline cannot feed, are refused when
the specs are built (:class:`UnsupportedModelError`, naming the feature and the fix): cross-attention and
encoder-decoder models, bidirectional (non-causal) attention, rotary scalings that depend on the sequence length
seen (``dynamic``, ``longrope``), a mixture-of-experts load-balancing loss (``output_router_logits``), layer types
other than full, sliding (and, for Llama 4, chunked) attention, architectures outside
:data:`SUPPORTED_MODEL_TYPES` (Bloom's and Falcon's attention bypasses ``AttentionInterface``, hybrids' recurrent
or convolution layers carry state along the sequence, DeepSeek-V3.2's sparse attention
picks its keys inside the layer: the refusal says so).
Attention masks (padding) are data, so they are refused at the first forward that carries one.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import json
import math
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ..runtime.slicing.attention import sliced_causal_attention
from ..runtime.slicing.context import token_offset
from ..runtime.slicing.documents import slice_positions
from .gpt import causal_lm_loss

try:
    import transformers
    from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
except ImportError as exc:  # pragma: no cover - exercised only where the extra is missing
    raise ImportError("ds_terapipe.models.hf needs transformers: pip install 'ds-terapipe[hf]' "
                      "(or pip install 'transformers>=5')") from exc

__all__ = ["ATTN_IMPLEMENTATION", "SUPPORTED_MODEL_TYPES", "UnsupportedModelError", "causal_lm_specs",
           "causal_lm_loss", "hf_param_name", "hf_state_dict", "HFEmbedding", "HFDecoderLayer", "HFFinalNorm",
           "HFLMHead"]

#: The name under which the sliced attention is registered in ``transformers.AttentionInterface``.
ATTN_IMPLEMENTATION = "ds_terapipe"


class UnsupportedModelError(ValueError):
    """A model or config uses a feature the token pipeline cannot run exactly; the message names the fix."""


def _sqrt_hidden_scale(config: PretrainedConfig, hidden: torch.Tensor) -> torch.Tensor:
    """Gemma: embeddings times sqrt(hidden_size), the factor rounded to the weights' dtype first (as Gemma's
    ``*TextScaledWordEmbedding`` holds it in a buffer of that dtype: 55.4256 is 55.5 in bf16)."""
    return hidden * torch.tensor(config.hidden_size ** 0.5).to(hidden.dtype)


def _embedding_multiplier(config: PretrainedConfig, hidden: torch.Tensor) -> torch.Tensor:
    """Granite: embeddings times ``config.embedding_multiplier`` (a Python float, as GraniteModel multiplies)."""
    return hidden * config.embedding_multiplier


def _mup_sqrt_hidden_scale(config: PretrainedConfig, hidden: torch.Tensor) -> torch.Tensor:
    """AFMoE: embeddings times sqrt(hidden_size) (a Python float) when ``config.mup_enabled``."""
    return hidden * (config.hidden_size ** 0.5) if config.mup_enabled else hidden


def _nanochat_norm(config: PretrainedConfig, hidden: torch.Tensor) -> torch.Tensor:
    """NanoChat: the embeddings through the model's weightless RMSNorm (the final norm's module, applied first)."""
    norm = importlib.import_module("transformers.models.nanochat.modeling_nanochat").NanoChatRMSNorm
    return norm(eps=config.rms_norm_eps)(hidden)


def _times_scale_emb(config: PretrainedConfig, hidden: torch.Tensor) -> torch.Tensor:
    """MiniCPM3: embeddings times ``config.scale_emb``, the factor in the weights' dtype (its embedding's buffer)."""
    return hidden * torch.tensor(config.scale_emb).to(hidden.dtype)


def _divide_by_logits_scaling(config: PretrainedConfig, logits: torch.Tensor) -> torch.Tensor:
    """Granite: logits divided by ``config.logits_scaling`` (divided, not multiplied by the inverse: bit-equal).
    MiniCPM3 divides the hidden states before its bias-free ``lm_head`` instead: the same up to rounding."""
    return logits / config.logits_scaling


def _times_logit_scale(config: PretrainedConfig, logits: torch.Tensor) -> torch.Tensor:
    """Cohere: logits times ``config.logit_scale``."""
    return logits * config.logit_scale


def _times_logits_scaling(config: PretrainedConfig, logits: torch.Tensor) -> torch.Tensor:
    """HyperCLOVA X: logits times ``config.logits_scaling`` (Granite divides by it)."""
    return logits * config.logits_scaling


def _rotary_per_theta(config: PretrainedConfig, layer_idx: int) -> PretrainedConfig | None:
    """Granite SWA: layer ``layer_idx`` rotates with base ``config.layer_rope_theta[layer_idx]``, none where it is 0
    (the *Model builds one rotary module per base and hands a theta-0 layer no position embeddings)."""
    theta = config.layer_rope_theta[layer_idx]
    if not theta:
        return None
    config = copy.deepcopy(config)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": theta}
    return config


def _rotary_unless_nope(config: PretrainedConfig, layer_idx: int) -> PretrainedConfig | None:
    """Cohere Compass: rotary as ``config`` gives it (a table per layer type), none for a layer type whose
    ``rope_parameters`` entry is None (the *Model hands those layers no position embeddings)."""
    return None if config.rope_parameters[config.layer_types[layer_idx]] is None else config


def _rms_final_norm_if_rms_eps(config: PretrainedConfig) -> dict[str, Any]:
    """Cohere 2-MoE: an RMSNorm final norm when ``config.rms_norm_eps`` is set, its LayerNorm otherwise."""
    if config.rms_norm_eps is None:
        return {}
    return {"final_norm": "Cohere2MoeRMSNorm", "norm_eps": "rms_norm_eps"}


def _dbrx_unrunnable(config: PretrainedConfig) -> str | None:
    """DBRX: what in ``config`` transformers' DBRX blocks cannot run, with the fix; None if nothing. The experts and
    router are sized by ``ffn_config.hidden_size``, which ``DbrxConfig`` sets from ``d_model`` before it reads a
    ``hidden_size`` argument; the attention reads ``attn_config.rope_theta`` when built (the rotary module takes
    ``rope_parameters``' base) and clamps q/k/v to ``[-clip_qkv, clip_qkv]``, which fails for None."""
    attn, width = config.attn_config, config.ffn_config.hidden_size
    if width != config.hidden_size:
        return (f"ffn_config.hidden_size={width} differs from d_model={config.hidden_size}, so the experts cannot take "
                "the hidden states (DbrxConfig(hidden_size=...) leaves them at the default width); build the config "
                "with d_model=... instead of hidden_size")
    if not hasattr(attn, "rope_theta"):
        return ("attn_config has no rope_theta, which transformers' DbrxAttention reads when it is built; set "
                "attn_config={..., 'rope_theta': <rope_parameters' rope_theta>} (DBRX checkpoints carry it)")
    if attn.clip_qkv is None:
        return ("attn_config.clip_qkv=None, which transformers' DbrxAttention passes to torch.clamp as both bounds "
                "(it refuses); set attn_config's clip_qkv to a positive number (DBRX checkpoints: 8)")
    return None


@dataclass(frozen=True)
class _Family:
    """Where one architecture keeps its parts, in ``transformers`` and in its checkpoints, and what its
    ``*Model`` / ``*ForCausalLM`` forward does around the decoder layers (redone by the pipeline layers)."""

    module: str  # transformers.models.<module>.modeling_<module>
    decoder_layer: str
    final_norm: str | None  # class name; None: nn.LayerNorm
    rotary: str | None  # class name; None: learned positions (GPT-2)
    base: str  # attribute of the *ForCausalLM holding the decoder stack
    layers: str  # attribute of the base holding the decoder layers
    embed: str  # attribute of the base (and of HFEmbedding) holding the token embedding
    norm: str  # attribute of the base (and of HFFinalNorm) holding the final norm
    norm_eps: str | None = "rms_norm_eps"  # config attribute of the final norm's epsilon; None: it takes none
    norm_sized: bool = True  # the final norm's class takes hidden_size (NanoChat's weightless RMSNorm takes eps only)
    norm_bias: bool = True  # the final norm has its class's default bias (DBRX's nn.LayerNorm(bias=False) has none)
    embed_padding: bool = True  # the embedding's padding_idx is config.pad_token_id (its row gets no gradient)
    embed_dropout: str | None = None  # config attribute of the dropout probability after the embedding
    # what the *Model does to the embeddings before the first layer: a scale (Gemma, Granite), a norm (NanoChat)
    embed_scale: Callable[[PretrainedConfig, torch.Tensor], torch.Tensor] | None = None
    head_bias: bool | str = False  # the LM head (``lm_head``) has a bias; a str: the config attribute that says
    logit_scale: Callable[[PretrainedConfig, torch.Tensor], torch.Tensor] | None = None
    # The *ForCausalLM caps its logits at config.final_logit_softcapping (when set): cap * tanh(logits / cap).
    final_softcap: bool = False
    # Which layers the *Model's mask gives config.sliding_window: "every layer" (when it is set), the
    # "sliding_attention" entries of config.layer_types, or None (the model has no sliding window).
    window: str | None = None
    # The config each layer's rotary module is built from, None for a layer without rotary (Granite SWA's theta per
    # layer, Cohere Compass' layer types without rope_parameters); None: every layer's is ``config``'s.
    layer_rotary: Callable[[PretrainedConfig, int], PretrainedConfig | None] | None = None
    zero_sinks: bool = False  # attention sinks initialised to zeros (Granite SWA), not normal (gpt-oss)
    # Fields whose value depends on the config (Cohere 2-MoE's final norm class): the overrides for this config.
    by_config: Callable[[PretrainedConfig], Mapping[str, Any]] | None = None
    # The *Model gives the "chunked_attention" entries of config.layer_types config.attention_chunk_size
    # (create_chunked_causal_mask: Llama 4); the others are "full_attention".
    chunked: bool = False
    # The attention reads how many tokens precede the call from its cache's get_seq_length() (Llama 4's temperature
    # tuning on NoPE layers): each layer is handed a _SliceOffset, which answers the slice's offset and holds nothing.
    offset_cache: bool = False
    # What in the config the family's transformers classes cannot build or run (DBRX's sizes and attention): the
    # reason and the fix, refused with the other features when the specs are built; None: nothing.
    unrunnable: Callable[[PretrainedConfig], str | None] | None = None


def _family(config: PretrainedConfig) -> _Family:
    """``config``'s family, with the fields that depend on the config (``_Family.by_config``) resolved."""
    family = _FAMILIES[config.model_type]
    return family if family.by_config is None else dataclasses.replace(family, **family.by_config(config))


def _llama_like(module: str, prefix: str, **quirks: Any) -> _Family:
    """A family laid out as Llama (``model.layers``, ``model.embed_tokens``, ``model.norm``, ``lm_head``), its
    classes named ``<prefix>DecoderLayer``, ``<prefix>RMSNorm``, ``<prefix>RotaryEmbedding``."""
    return _Family(module, f"{prefix}DecoderLayer", quirks.pop("final_norm", f"{prefix}RMSNorm"),
                   f"{prefix}RotaryEmbedding", base="model", layers="layers", embed="embed_tokens",
                   norm=quirks.pop("norm", "norm"), **quirks)


_LAYER_NORM = dict(final_norm=None, norm_eps="layer_norm_eps")  # a plain nn.LayerNorm as the final norm
_EVERY_LAYER, _LAYER_TYPES = "every layer", "layer_types"  # _Family.window
_FAMILIES: dict[str, _Family] = {
    "llama": _llama_like("llama", "Llama"),
    "mistral": _llama_like("mistral", "Mistral", window=_EVERY_LAYER),
    "qwen2": _llama_like("qwen2", "Qwen2", window=_LAYER_TYPES),
    "qwen3": _llama_like("qwen3", "Qwen3", window=_LAYER_TYPES),
    "gpt2": _Family("gpt2", "GPT2Block", None, None, base="transformer", layers="h", embed="wte", norm="ln_f",
                    norm_eps="layer_norm_epsilon", embed_padding=False, embed_dropout="embd_pdrop"),
    "gemma": _llama_like("gemma", "Gemma", embed_scale=_sqrt_hidden_scale),
    "gemma2": _llama_like("gemma2", "Gemma2", embed_scale=_sqrt_hidden_scale, window=_LAYER_TYPES,
                          final_softcap=True),
    "gemma3_text": _llama_like("gemma3", "Gemma3", embed_scale=_sqrt_hidden_scale, window=_LAYER_TYPES,
                               final_softcap=True),
    "phi3": _llama_like("phi3", "Phi3", window=_EVERY_LAYER),
    "olmo": _llama_like("olmo", "Olmo", final_norm="OlmoLayerNorm", norm_eps=None),
    "olmo2": _llama_like("olmo2", "Olmo2"),
    "granite": _llama_like("granite", "Granite", embed_scale=_embedding_multiplier,
                           logit_scale=_divide_by_logits_scaling),
    "cohere": _llama_like("cohere", "Cohere", final_norm="CohereLayerNorm", norm_eps="layer_norm_eps",
                          logit_scale=_times_logit_scale),
    "smollm3": _llama_like("smollm3", "SmolLM3", window=_LAYER_TYPES),
    "stablelm": _llama_like("stablelm", "StableLm", **_LAYER_NORM),
    "starcoder2": _llama_like("starcoder2", "Starcoder2", final_norm=None, norm_eps="norm_epsilon",
                              embed_dropout="embedding_dropout", window=_EVERY_LAYER),
    "phi": _llama_like("phi", "Phi", **_LAYER_NORM, norm="final_layernorm", embed_dropout="embd_pdrop",
                       head_bias=True),
    "gpt_neox": _Family("gpt_neox", "GPTNeoXLayer", None, "GPTNeoXRotaryEmbedding", base="gpt_neox",
                        layers="layers", embed="embed_in", norm="final_layer_norm", norm_eps="layer_norm_eps",
                        embed_padding=False, embed_dropout="hidden_dropout"),
    "mixtral": _llama_like("mixtral", "Mixtral", window=_EVERY_LAYER),
    "qwen3_moe": _llama_like("qwen3_moe", "Qwen3Moe", window=_EVERY_LAYER),
    "glm": _llama_like("glm", "Glm"),
    "glm4": _llama_like("glm4", "Glm4"),
    "helium": _llama_like("helium", "Helium"),
    "ministral": _llama_like("ministral", "Ministral", window=_LAYER_TYPES),
    "olmo3": _llama_like("olmo3", "Olmo3", window=_LAYER_TYPES),
    "exaone4": _llama_like("exaone4", "Exaone4", window=_LAYER_TYPES),
    "seed_oss": _llama_like("seed_oss", "SeedOss"),
    "arcee": _llama_like("arcee", "Arcee"),
    "apertus": _llama_like("apertus", "Apertus"),
    "hunyuan_v1_dense": _llama_like("hunyuan_v1_dense", "HunYuanDenseV1"),
    "hunyuan_v1_moe": _llama_like("hunyuan_v1_moe", "HunYuanMoEV1"),
    "olmoe": _llama_like("olmoe", "Olmoe"),
    "flex_olmo": _llama_like("flex_olmo", "FlexOlmo"),
    "phimoe": _llama_like("phimoe", "Phimoe", final_norm=None, head_bias="lm_head_bias", window=_EVERY_LAYER),
    "glm4_moe": _llama_like("glm4_moe", "Glm4Moe"),
    "ernie4_5": _llama_like("ernie4_5", "Ernie4_5"),
    "ernie4_5_moe": _llama_like("ernie4_5_moe", "Ernie4_5_Moe", head_bias="use_bias"),
    "nemotron": _llama_like("nemotron", "Nemotron", final_norm="NemotronLayerNorm1P", norm_eps="norm_eps"),
    "dots1": _llama_like("dots1", "Dots1", window=_LAYER_TYPES),
    "minimax_m2": _llama_like("minimax_m2", "MiniMaxM2"),
    "exaone_moe": _llama_like("exaone_moe", "ExaoneMoe", window=_LAYER_TYPES),
    "ministral3": _llama_like("ministral3", "Ministral3", window=_EVERY_LAYER),
    "vaultgemma": _llama_like("vaultgemma", "VaultGemma", embed_scale=_sqrt_hidden_scale, window=_LAYER_TYPES,
                              final_softcap=True),
    "solar_open": _llama_like("solar_open", "SolarOpen"),
    "bitnet": _llama_like("bitnet", "BitNet"),
    "jetmoe": _llama_like("jetmoe", "JetMoe"),
    "mellum": _llama_like("mellum", "Mellum", window=_LAYER_TYPES),
    "jais2": _llama_like("jais2", "Jais2", **_LAYER_NORM),
    "hyperclovax": _llama_like("hyperclovax", "HyperCLOVAX", embed_scale=_embedding_multiplier,
                               logit_scale=_times_logits_scaling),
    "afmoe": _llama_like("afmoe", "Afmoe", embed_scale=_mup_sqrt_hidden_scale, window=_LAYER_TYPES),
    "nanochat": _llama_like("nanochat", "NanoChat", embed_scale=_nanochat_norm, norm_sized=False,
                            final_softcap=True),
    "persimmon": _llama_like("persimmon", "Persimmon", **_LAYER_NORM, norm="final_layernorm"),
    "cwm": _llama_like("cwm", "Cwm", window=_LAYER_TYPES),
    "kolibri1": _llama_like("kolibri1", "Kolibri1", window=_LAYER_TYPES),
    "hy_v3": _llama_like("hy_v3", "HYV3"),
    "aria_text": _llama_like("aria", "AriaText"),
    "cohere2": _llama_like("cohere2", "Cohere2", final_norm="Cohere2LayerNorm", norm_eps="layer_norm_eps",
                           logit_scale=_times_logit_scale, window=_LAYER_TYPES),
    "qwen2_moe": _llama_like("qwen2_moe", "Qwen2Moe", window=_LAYER_TYPES),
    "granitemoe": _llama_like("granitemoe", "GraniteMoe", embed_scale=_embedding_multiplier,
                              logit_scale=_divide_by_logits_scaling),
    "granitemoeshared": _llama_like("granitemoeshared", "GraniteMoeShared", embed_scale=_embedding_multiplier,
                                    logit_scale=_divide_by_logits_scaling),
    "gpt_oss": _llama_like("gpt_oss", "GptOss", window=_LAYER_TYPES),   # attention sinks (s_aux)
    "deepseek_v2": _llama_like("deepseek_v2", "DeepseekV2"),   # latent attention: value dim != key dim
    "deepseek_v3": _llama_like("deepseek_v3", "DeepseekV3"),
    "sarvam_mla": _llama_like("deepseek_v3", "DeepseekV3"),   # DeepSeek-V3's classes, its own config
    "youtu": _llama_like("youtu", "Youtu"),   # latent attention
    "glm4_moe_lite": _llama_like("glm4_moe_lite", "Glm4MoeLite"),   # latent attention
    "minicpm3": _llama_like("minicpm3", "MiniCPM3", embed_scale=_times_scale_emb,   # latent attention
                            logit_scale=_divide_by_logits_scaling),
    "mimo_v2_flash": _llama_like("mimo_v2_flash", "MiMoV2Flash", window=_LAYER_TYPES),   # sinks on sliding layers
    "granite_swa": _llama_like("granite_swa", "GraniteSWA", embed_scale=_embedding_multiplier,   # sinks
                               logit_scale=_divide_by_logits_scaling, window=_LAYER_TYPES,
                               layer_rotary=_rotary_per_theta, zero_sinks=True),
    "granitemoe_swa": _llama_like("granitemoe_swa", "GraniteMoeSWA", embed_scale=_embedding_multiplier,
                                  logit_scale=_divide_by_logits_scaling, window=_LAYER_TYPES,
                                  layer_rotary=_rotary_per_theta, zero_sinks=True),
    "cohere2_moe": _llama_like("cohere2_moe", "Cohere2Moe", final_norm="Cohere2MoeLayerNorm",
                               norm_eps="layer_norm_eps", logit_scale=_times_logit_scale, window=_LAYER_TYPES,
                               by_config=_rms_final_norm_if_rms_eps),
    "laguna": _llama_like("laguna", "Laguna", window=_LAYER_TYPES),
    "apertus1p5_text": _llama_like("apertus1p5", "Apertus1p5Text"),
    "cohere_compass_text": _llama_like("cohere_compass", "CohereCompass", final_norm="CohereCompassLayerNorm",
                                       norm_eps="layer_norm_eps", window=_LAYER_TYPES,
                                       layer_rotary=_rotary_unless_nope),
    "llama4_text": _llama_like("llama4", "Llama4Text", chunked=True, offset_cache=True),
    # q/k/v clipped (clip_qkv) and experts routed per token inside the blocks; a bias-free LayerNorm final norm
    "dbrx": _Family("dbrx", "DbrxBlock", None, "DbrxRotaryEmbedding", base="transformer", layers="blocks",
                    embed="wte", norm="norm_f", norm_eps=None, norm_bias=False,
                    unrunnable=_dbrx_unrunnable),
}

# Architectures transformers has as causal LMs that cannot be routed here, and why (the generic refusal otherwise).
_UNROUTABLE = {
    "bloom": "BloomAttention computes its scores itself (ALiBi biases added with baddbmm), not through "
             "transformers' AttentionInterface, so its layers cannot attend over the earlier slices' keys",
    "falcon": "FalconAttention calls SDPA or its eager ALiBi path itself, not transformers' AttentionInterface, "
              "so its layers cannot attend over the earlier slices' keys",
    "modernbert-decoder": "its embedding module normalises the token embeddings itself and its head runs a dense "
                          "layer, an activation and a LayerNorm before the vocabulary projection, not the "
                          "embedding, final norm and LM head the pipeline builds",
    "diffllama": "not verified exact: the gradients of its differential-attention lambda vectors match "
                 "transformers' to ~2e-4 in fp32 (even unsliced), above the 1e-5 every supported type is held to",
    "emu3": "Emu3 is an image-and-text model (its config nests the text model's beside a VQ image tokenizer); "
            "the pipeline takes decoder-only text configs",
}
# DeepSeek Sparse Attention: an indexer scores every visible key per query and the attention reads only the top
# index_topk; per query it is exact in principle, but the indexer runs inside the layer, outside AttentionInterface.
_UNROUTABLE.update(dict.fromkeys(
    ("deepseek_v32", "glm_moe_dsa"),
    "its sparse attention's indexer picks each query's top index_topk keys inside the layer, outside transformers' "
    "AttentionInterface, from the keys of the running call and the model's mask, so a token slice would choose among "
    "its own keys only, not the earlier slices'"))
# Hybrids: state-space, linear-attention, recurrent or convolution layers carry a state along the sequence that a
# slice would need from the slice before it; only attention layers read the earlier slices (through their keys).
_UNROUTABLE.update(dict.fromkeys(
    ("mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "zamba", "zamba2", "falcon_h1", "nemotron_h",
     "granitemoehybrid", "olmo_hybrid", "bailing_hybrid", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
     "qwen3_5_moe_text", "kimi_linear", "minimax", "lfm2", "lfm2_moe", "lfm3", "recurrent_gemma", "rwkv", "xlstm",
     "zaya"),
    "its state-space, linear-attention, recurrent or convolution layers carry a state along the sequence that a "
    "token slice would need from the slice before it; only attention layers can be token-sliced"))

#: ``config.model_type`` values :func:`causal_lm_specs` accepts.
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)


def _length_dependent(rope_type: str) -> bool:
    """Whether a rotary scaling's frequencies depend on the longest position seen in the call (a slice sees fewer
    positions than the whole sequence, so it would rotate differently): transformers' ``dynamic_rope_update``
    recomputes any type with "dynamic" in its name, and "longrope"."""
    return rope_type == "longrope" or "dynamic" in rope_type


def _resolved_rope_types(config: PretrainedConfig, family: _Family) -> list[str]:
    """The rope types the family's rotary module runs with, as ``dynamic_rope_update`` reads them (a string, or
    one per layer type). Why not the config's: a module may resolve a type itself (HunYuan's checkpoints say
    "dynamic" with a fixed ``alpha``, which its rotary runs as the static "ntk_alpha")."""
    rotary = getattr(_modeling(family), family.rotary)(config=config)
    rope_type = getattr(rotary, "rope_type", "default")
    return list(rope_type.values()) if isinstance(rope_type, Mapping) else [rope_type]


def _modeling(family: _Family) -> Any:
    return importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")


def _layers_of_type(config: PretrainedConfig, kind: str) -> list[bool]:
    """Which decoder layers ``config.layer_types`` makes ``kind`` (the others are 'full_attention'); or
    :class:`UnsupportedModelError` for any other layer type."""
    num_layers = config.num_hidden_layers
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
    unknown = sorted(set(layer_types) - {"full_attention", kind})
    if unknown or len(layer_types) != num_layers:
        raise UnsupportedModelError(f"{config.model_type}: layer_types={layer_types} must name each of the "
                                    f"{num_layers} layers 'full_attention' or '{kind}'; other "
                                    f"attention types ({', '.join(unknown) or 'none'}) are not supported")
    return [layer_type == kind for layer_type in layer_types]


def _sized(config: PretrainedConfig, layers: list[bool], attr: str, what: str, noun: str,
           meaning: str) -> list[int | None]:
    """``config.<attr>`` for the ``layers`` that use it, None for the others; :class:`UnsupportedModelError` when
    some use it and it is no positive int."""
    size = getattr(config, attr, None)
    if any(layers) and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise UnsupportedModelError(f"{config.model_type}: {sum(layers)} of {len(layers)} layers use {what} "
                                    f"attention but {attr}={size!r}; set {attr} to the {noun} (a "
                                    f"positive int: {meaning}) or make those layers 'full_attention'")
    return [size if used else None for used in layers]


def _layer_windows(config: PretrainedConfig, family: _Family) -> list[int | None]:
    """Each decoder layer's sliding window as the model's own mask gives it (``create_sliding_window_causal_mask``:
    ``config.sliding_window`` for the layers it covers), None for full causal attention; or
    :class:`UnsupportedModelError` for layer types this module does not know, or sliding layers without a window."""
    if family.window is None:
        return [None] * config.num_hidden_layers
    if family.window == _EVERY_LAYER:
        sliding = [getattr(config, "sliding_window", None) is not None] * config.num_hidden_layers
    else:
        sliding = _layers_of_type(config, "sliding_attention")
    return _sized(config, sliding, "sliding_window", "sliding-window", "window",
                  "the keys a query sees, itself included")


def _layer_chunks(config: PretrainedConfig, family: _Family) -> list[int | None]:
    """Each decoder layer's attention chunk as the model's own mask gives it (``create_chunked_causal_mask``:
    ``config.attention_chunk_size`` on the ``'chunked_attention'`` layers of ``layer_types``), None for full causal
    attention; or :class:`UnsupportedModelError` for other layer types, or chunked layers without a chunk size."""
    if not family.chunked:
        return [None] * config.num_hidden_layers
    return _sized(config, _layers_of_type(config, "chunked_attention"), "attention_chunk_size", "chunked", "chunk",
                  "the tokens of a chunk")


# The running decoder layer's window and chunk (HFDecoderLayer sets them around transformers' layer, which calls
# terapipe_attention): the model's mask, not the attention call's ``sliding_window`` argument, decides them (some
# layers pass none, Qwen2-MoE's; none passes a chunk).
_LAYER = threading.local()
_UNSET = object()


@contextmanager
def _layer_window(window: int | None, chunk: int | None = None) -> Iterator[None]:
    previous = getattr(_LAYER, "window", _UNSET), getattr(_LAYER, "chunk", None)
    _LAYER.window, _LAYER.chunk = window, chunk
    try:
        yield
    finally:
        _LAYER.window, _LAYER.chunk = previous


class _SliceOffset:
    """What Llama 4's attention asks of its cache, answered for the running slice: ``get_seq_length()`` is how many
    tokens of the row precede this call's (``token_offset()``: the slice's start, its share's under sequence
    parallelism; 0 outside a pipeline), so the temperature tuning of its NoPE layers scales each query by its true
    position, as the unsliced model's ``arange(T)`` does; ``update`` keeps nothing (the slice's own KV buffers
    carry the keys)."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return token_offset()

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return key, value


# -- the attention function ------------------------------------------------------------------------------------
def terapipe_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature over :func:`~ds_terapipe.sliced_causal_attention`.

    query (B, nh, T, hs), key/value (B, nkv, T, hs) for the running slice; returns ((B, T, nh, hs), None).
    """
    if attention_mask is not None:
        raise UnsupportedModelError(
            "ds_terapipe attention got an attention mask: padding masks are not supported with token slicing; "
            "feed full-length sequences without padding (pack documents, as pretraining does) and call the "
            "layers without attention_mask")
    given = kwargs.get("sliding_window")
    window, chunk = getattr(_LAYER, "window", _UNSET), getattr(_LAYER, "chunk", None)
    if window is _UNSET:   # called outside the pipeline's decoder layers: the layer's own argument and chunk
        window, chunk = given, _own_chunk(module)
    elif given is not None and given != window:
        raise UnsupportedModelError(f"ds_terapipe attention: {type(module).__name__} passes sliding_window={given} "
                                    f"but the model's mask gives this layer window={window}; the pipeline follows "
                                    "the mask, and cannot tell which one this model means: set config.sliding_window "
                                    "and config.layer_types so that both agree")
    if not getattr(module, "is_causal", True):
        raise UnsupportedModelError(f"ds_terapipe attention: {type(module).__name__} is not causal (cross- or "
                                    "bidirectional attention); only causal self-attention can be token-sliced")
    # Grouped-query attention: k/v keep their num_kv_heads (so does the KV cache); SDPA pairs the heads.
    # Softcapped scores (Gemma 2) take the plain-math path, in transformers' eager order; so do attention sinks
    # (gpt-oss passes its per-head logits as s_aux) except on the CPU's fused blocks. Keys wider than values
    # (DeepSeek's latent attention: qk_nope + qk_rope vs v_head_dim) pass as they are: SDPA and the cache take both.
    # Llama 4's chunked layers attend within their chunks (the chunk the layer's mask gives, as the window).
    out = sliced_causal_attention(query, key, value, cache_key=module, dropout_p=dropout, scale=scaling,
                                  window=window, softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"),
                                  chunk=chunk)
    return out.transpose(1, 2), None  # (B, T, nh, hs)


AttentionInterface.register(ATTN_IMPLEMENTATION, terapipe_attention)


def _own_chunk(module: nn.Module) -> int | None:
    """The chunk the model's mask gives the layer of ``module`` (Llama 4's attention holds its config and layer
    index), for a call outside the pipeline's decoder layers (a whole model run with the attention routed here); None
    for attention of other families."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    family = _FAMILIES.get(getattr(config, "model_type", None))
    if family is None or not family.chunked or not isinstance(index, int):
        return None
    return _layer_chunks(config, family)[index]


# -- refusals --------------------------------------------------------------------------------------------------
def _check_config(config: PretrainedConfig) -> _Family:
    """The architecture's family, or :class:`UnsupportedModelError` naming the feature and the fix."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{model_type}: encoder-decoder models (cross-attention) are not supported by "
                                    "the token pipeline; use a decoder-only causal LM")
    if getattr(config, "add_cross_attention", False):
        raise UnsupportedModelError(f"{model_type}: cross-attention (config.add_cross_attention=True) is not "
                                    "supported; set add_cross_attention=False (a decoder-only causal LM)")
    if getattr(config, "use_bidirectional_attention", False) or getattr(config, "is_causal", True) is False:
        raise UnsupportedModelError(f"{model_type}: non-causal (bidirectional) attention mixes later tokens into "
                                    "earlier ones, so it cannot be token-sliced; use a causal LM config")
    if model_type not in _FAMILIES:
        why = f" ({_UNROUTABLE[model_type]})" if model_type in _UNROUTABLE else ""
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported by ds_terapipe.models.hf{why}; "
                                    f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (or write the model as "
                                    "LayerSpecs with ds_terapipe.sliced_causal_attention, see README)")
    family = _family(config)
    why = family.unrunnable(config) if family.unrunnable is not None else None
    if why is not None:
        raise UnsupportedModelError(f"{model_type}: {why}")
    _layer_windows(config, family)  # refuses layer types it does not know, sliding layers without a window
    _layer_chunks(config, family)   # and chunked layers without a chunk
    if family.rotary is not None:
        rope = getattr(config, "rope_parameters", None) or {}
        tables: list[Mapping] = []
        if isinstance(rope, Mapping):  # one table, or one per layer type (Gemma 3: {"full_attention": {...}, ...})
            tables = [table for table in rope.values() if isinstance(table, Mapping)] or [rope]
        for table in tables:
            rope_type = table.get("rope_type", "default")
            if _length_dependent(rope_type) and any(map(_length_dependent, _resolved_rope_types(config, family))):
                raise UnsupportedModelError(f"{model_type}: rope_type {rope_type!r} rescales positions by the "
                                            "length seen in a call, so a slice would rotate differently from the "
                                            "whole sequence; use a static rope type (default, linear, llama3, yarn)")
    if getattr(config, "output_router_logits", False):
        raise UnsupportedModelError(f"{model_type}: the mixture-of-experts load-balancing loss "
                                    "(config.output_router_logits=True) averages router statistics over the whole "
                                    "batch, which neither a slice nor causal_lm_loss sees; set "
                                    "output_router_logits=False (routing itself is per token and runs exactly)")
    return family


def _attention_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of ``config`` that routes attention through :func:`terapipe_attention`."""
    config = copy.deepcopy(config)
    config._attn_implementation = ATTN_IMPLEMENTATION
    config.use_cache = False
    return config


# -- pipeline layers -------------------------------------------------------------------------------------------
def _init_hf_style_(module: nn.Module, config: PretrainedConfig, seed: int, num_layers: int) -> None:
    """transformers' initialisation (normal(0, initializer_range) weights, zero biases, norms as built; GPT-2's
    residual projections scaled by 1/sqrt(2 n_layer); matrices held outside nn.Linear, as mixture-of-experts
    routers and stacked experts are, normal too, biases held outside it zero, attention sinks normal, or zero where
    the family's are: Granite SWA's) from a private generator: weights depend only on (seed, layer), so any number
    of stages builds the same model."""
    gen = torch.Generator().manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    gpt2 = config.model_type == "gpt2"
    zero_sinks = _family(config).zero_sinks
    with torch.no_grad():
        for sub_name, sub in module.named_modules():
            if isinstance(sub, (nn.Linear, nn.Embedding)) or type(sub).__name__ == "Conv1D":
                weight = sub.weight
                scale = std / math.sqrt(2 * num_layers) if gpt2 and sub_name.endswith("c_proj") else std
                weight.copy_(torch.randn(weight.shape, generator=gen) * scale)
                if isinstance(sub, nn.Embedding) and sub.padding_idx is not None:
                    weight[sub.padding_idx].zero_()
                bias = getattr(sub, "bias", None)
                if isinstance(bias, nn.Parameter):
                    bias.zero_()
                continue
            # built empty (torch.empty) by their modules: matrices normal, biases zero, attention sinks normal
            for name, param in sub.named_parameters(recurse=False):
                if name.endswith("bias") or (name == "sinks" and zero_sinks):
                    param.zero_()
                elif param.dim() >= 2 or name == "sinks":
                    param.copy_(torch.randn(param.shape, generator=gen) * std)


def _adopt(source: nn.Module, config: PretrainedConfig) -> nn.Module:
    """Point every submodule of a loaded model's layer that holds the model's config at ``config`` (the same
    values, attention routed through ds_terapipe); weights stay where they are, nothing is copied."""
    for sub in source.modules():
        if isinstance(getattr(sub, "config", None), PretrainedConfig):
            sub.config = config
    return source


class _Checkpoint:
    """The safetensors files of a ``save_pretrained`` directory, read tensor by tensor when a layer is built,
    so each rank reads only its own stage's weights (``from_pretrained`` would load the whole model per rank).

    Tensor names are the ``transformers`` model's (:func:`hf_param_name`); GPT-2 checkpoints written without the
    ``transformer.`` prefix are read too. Parameters take ``dtype`` (None: as built, fp32); the rotary
    frequencies stay fp32, as ``from_pretrained`` keeps them.
    """

    def __init__(self, path: Path, files: dict[str, Path], config: PretrainedConfig,
                 dtype: torch.dtype | None) -> None:
        self.path, self.files, self.config, self.dtype = path, files, config, dtype

    @classmethod
    def find(cls, path: Path, config: PretrainedConfig, dtype: torch.dtype | None) -> _Checkpoint | None:
        """The directory's safetensors weights, or None when it has none (then ``from_pretrained`` loads it)."""
        from safetensors import safe_open

        index, single = path / "model.safetensors.index.json", path / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return cls(path, {key: path / name for key, name in weight_map.items()}, config, dtype)
        if single.is_file():
            with safe_open(str(single), framework="pt") as f:
                return cls(path, {key: single for key in f.keys()}, config, dtype)
        return None

    def load_into(self, module: nn.Module, index: int) -> None:
        """Fill pipeline layer ``index`` (its parameters and persistent buffers) from the checkpoint."""
        from safetensors import safe_open

        base = _family(self.config).base + "."
        keys = {}
        for name in module.state_dict():
            key = hf_param_name(f"{index}.{name}", self.config)
            if key not in self.files and key.removeprefix(base) in self.files:
                key = key.removeprefix(base)  # GPT-2 checkpoints of the original layout
            if key not in self.files:
                raise ValueError(f"{self.path}: no tensor {key!r} for pipeline layer {index} "
                                 f"({type(module).__name__}.{name}); the weights do not match config.json")
            keys[name] = key
        state = {}
        for file in sorted(set(self.files[key] for key in keys.values())):
            with safe_open(str(file), framework="pt") as f:
                state.update({name: f.get_tensor(key) for name, key in keys.items() if self.files[key] == file})
        module.load_state_dict(state, strict=True)
        if self.dtype is not None:
            for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
                if name in state and tensor.is_floating_point():
                    tensor.data = tensor.data.to(self.dtype)


def _fill(module: nn.Module, config: PretrainedConfig, index: int, seed: int,
          checkpoint: _Checkpoint | None) -> None:
    """Weights of pipeline layer ``index``: from the checkpoint, else transformers-style random init."""
    if checkpoint is not None:
        checkpoint.load_into(module, index)
    else:
        _init_hf_style_(module, config, seed + index, config.num_hidden_layers)


def _plain_embedding(embedding: nn.Embedding) -> nn.Embedding:
    """``embedding``'s table (the same Parameter, not a copy) in a plain ``nn.Embedding``.

    Why: a subclass that scales in its forward (Gemma's ``*TextScaledWordEmbedding``) would be replaced by the
    vocabulary-parallel split, which looks rows up only, and its scale lost; :class:`HFEmbedding` applies the
    family's scale itself, after the lookup, whatever does the lookup."""
    if type(embedding) is nn.Embedding:
        return embedding
    plain = nn.Embedding(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, device="meta")
    plain.weight = embedding.weight
    return plain


class HFEmbedding(nn.Module):
    """Token embedding, then what the family's ``*Model`` does to it before the first layer (Gemma's and Granite's
    scale, dropout; GPT-2: plus learned positions from :func:`token_offset`); also the tied LM head."""

    def __init__(self, config: PretrainedConfig, source: nn.Module | None = None, seed: int = 0,
                 checkpoint: _Checkpoint | None = None) -> None:
        super().__init__()
        self.family = _family(config)
        self.config = config
        self.is_gpt2 = self.family.rotary is None
        dropout = getattr(config, self.family.embed_dropout, 0.0) if self.family.embed_dropout else 0.0
        self.drop = nn.Dropout(dropout or 0.0)
        if source is not None:
            setattr(self, self.family.embed, _plain_embedding(getattr(source, self.family.embed)))
            if self.is_gpt2:
                self.wpe = source.wpe
            return
        setattr(self, self.family.embed,
                nn.Embedding(config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None)
                             if self.family.embed_padding else None))
        if self.is_gpt2:
            self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        _fill(self, config, 0, seed, checkpoint)

    @property
    def token_embedding(self) -> nn.Embedding:
        return getattr(self, self.family.embed)

    def forward(self, ids: Any) -> torch.Tensor:
        if isinstance(ids, (tuple, list)):
            raise UnsupportedModelError(
                f"HFEmbedding got {len(ids)} inputs; it takes token ids (B, T) only. Attention/padding masks are "
                "not supported with token slicing: feed full-length sequences without padding (pack documents)")
        hidden = self.token_embedding(ids)  # (B, T, C)
        if self.family.embed_scale is not None:
            hidden = self.family.embed_scale(self.config, hidden)
        if not self.is_gpt2:
            return self.drop(hidden)
        # (T,), or (B, T) within each packed document
        pos = slice_positions(ids.shape[1], ids.device, self.wpe.num_embeddings,
                              "HFEmbedding: positions up to {end} exceed n_positions={max_positions}; use shorter "
                              "sequences or a config with more positions")
        return self.drop(hidden + self.wpe(pos))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.token_embedding.weight)  # (B, T, V)
        return _head_logits(self.family, self.config, logits)


def _head_logits(family: _Family, config: PretrainedConfig, logits: torch.Tensor) -> torch.Tensor:
    """What the family's *ForCausalLM does to ``lm_head``'s output: its logit scale, its final softcap."""
    if family.logit_scale is not None:
        logits = family.logit_scale(config, logits)
    cap = getattr(config, "final_logit_softcapping", None) if family.final_softcap else None
    if cap is not None:   # as Gemma2ForCausalLM: divide, tanh, multiply
        logits = torch.tanh(logits / cap) * cap
    return logits


def _tied_head(embedding: HFEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    return embedding.head(hidden)


class HFDecoderLayer(nn.Module):
    """One ``transformers`` decoder layer (``self.layer``, unmodified) fed the slice's true positions."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, source: nn.Module | None = None,
                 seed: int = 0, checkpoint: _Checkpoint | None = None) -> None:
        super().__init__()
        family = _family(config)
        modeling = _modeling(family)
        if source is not None:
            self.layer = _adopt(source, config)
        else:
            self.layer = getattr(modeling, family.decoder_layer)(config, layer_idx=layer_idx)
        # The rotary module has no parameters; each layer keeps its own, so a stage needs nothing from others. Built
        # from the layer's rotary config where the family has one per layer (None: the layer rotates nothing).
        rotary_config = config if family.layer_rotary is None else family.layer_rotary(config, layer_idx)
        with_rotary = family.rotary is not None and rotary_config is not None
        self.rotary = getattr(modeling, family.rotary)(config=rotary_config) if with_rotary else None
        # A rotary module with a table per layer type (Gemma 3: local and global bases) is asked for this layer's.
        self.rotary_kwargs: dict[str, str] = {}
        if self.rotary is not None and "layer_type" in inspect.signature(self.rotary.forward).parameters:
            self.rotary_kwargs["layer_type"] = config.layer_types[layer_idx]
        self.window = _layer_windows(config, family)[layer_idx]  # the sliding window of its mask, or None
        self.chunk = _layer_chunks(config, family)[layer_idx]    # the attention chunk of its mask, or None
        self.offset_cache = _SliceOffset() if family.offset_cache else None
        if source is None:
            _fill(self, config, 1 + layer_idx, seed, checkpoint)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.rotary is None:  # GPT-2: positions were added by the embedding; Granite SWA's theta-0 layers: none
            with _layer_window(self.window, self.chunk):
                return self.layer(hidden)
        position_ids = slice_positions(hidden.shape[1], hidden.device)  # (T,), or (B, T) for packed rows
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)  # (1, T)
        position_embeddings = self.rotary(hidden, position_ids, **self.rotary_kwargs)  # cos, sin: (1 or B, T, hs)
        cache = {} if self.offset_cache is None else {"cache": self.offset_cache}
        with _layer_window(self.window, self.chunk):
            return self.layer(hidden, attention_mask=None, position_ids=position_ids,
                              position_embeddings=position_embeddings, **cache)


class HFFinalNorm(nn.Module):
    """The final norm (the family's RMSNorm or LayerNorm class, or ``nn.LayerNorm``, with or without a bias;
    GPT-2's ``ln_f``)."""

    def __init__(self, config: PretrainedConfig, source: nn.Module | None = None,
                 checkpoint: _Checkpoint | None = None) -> None:
        super().__init__()
        family = _family(config)
        self.attr = family.norm
        if source is not None:
            setattr(self, self.attr, source)
            return
        cls = nn.LayerNorm if family.final_norm is None else getattr(_modeling(family), family.final_norm)
        kwargs = {} if family.norm_eps is None else {"eps": getattr(config, family.norm_eps)}
        if not family.norm_bias:
            kwargs["bias"] = False
        setattr(self, self.attr, cls(config.hidden_size, **kwargs) if family.norm_sized else cls(**kwargs))
        if checkpoint is not None:  # built norms are ones (and zeros), as transformers initialises them
            checkpoint.load_into(self, config.num_hidden_layers + 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.attr)(hidden)


class HFLMHead(nn.Module):
    """An untied LM head ``lm_head`` (B, T, C) -> (B, T, V), then the family's logit scale (Granite, Cohere) and
    final softcap (Gemma 2/3)."""

    def __init__(self, config: PretrainedConfig, source: nn.Module | None = None, seed: int = 0,
                 checkpoint: _Checkpoint | None = None) -> None:
        super().__init__()
        self.family, self.config = _family(config), config
        if source is not None:
            self.lm_head = source
            return
        bias = self.family.head_bias
        bias = bool(getattr(config, bias)) if isinstance(bias, str) else bias
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=bias)
        _fill(self, config, config.num_hidden_layers + 2, seed, checkpoint)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return _head_logits(self.family, self.config, logits)


# -- specs -----------------------------------------------------------------------------------------------------
def _checkpoint_dtype(config: PretrainedConfig, requested: Any) -> torch.dtype | None:
    """``dtype`` as ``from_pretrained`` resolves it: "auto" (its default) means config.json's ``dtype``."""
    if requested is None or isinstance(requested, torch.dtype):
        return requested
    if requested != "auto":
        raise ValueError(f"causal_lm_specs: load_kwargs dtype={requested!r}; use a torch.dtype or 'auto'")
    stored = getattr(config, "dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) else None


def _renamed_on_load(config: PretrainedConfig) -> bool:
    """Whether ``transformers`` converts this architecture's checkpoint tensors on loading (GPT-NeoX's
    ``embed_out`` is ``lm_head``; the mixture-of-experts' per-expert matrices are stacked into one tensor), so
    the files do not hold the modules' names and only ``from_pretrained`` can read them."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # pragma: no cover - a transformers without conversions stores the modules' names
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # the causal LM class too: a conversion may be registered under it alone (GPT-NeoX), and a config.json
    # without "architectures" still loads as it
    names = [config.model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, ""),
             *(getattr(config, "architectures", None) or ())]
    return any(get_checkpoint_conversion_mapping(name) for name in names if name)


def _load(model_or_config: Any, load_kwargs: Mapping[str, Any] | None
          ) -> tuple[PretrainedConfig, Any, _Checkpoint | None]:
    """(config, loaded model or None, checkpoint reader or None) from a config, a model or a local directory."""
    if isinstance(model_or_config, PretrainedConfig):
        return model_or_config, None, None
    if isinstance(model_or_config, PreTrainedModel):
        return model_or_config.config, model_or_config, None
    if not isinstance(model_or_config, (str, os.PathLike)):
        raise TypeError(f"causal_lm_specs takes a transformers config, a loaded *ForCausalLM model or a local "
                        f"directory, got {type(model_or_config).__name__}")
    path = Path(model_or_config)
    if not path.is_dir():
        raise ValueError(f"causal_lm_specs: {str(path)!r} is not a local directory; pass a directory written by "
                         "save_pretrained, a loaded model, or a config (nothing is downloaded)")
    load_kwargs = dict(load_kwargs or {})
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    _check_config(config)  # refuse before reading any weights
    if set(load_kwargs) <= {"dtype"} and not _renamed_on_load(config):
        checkpoint = _Checkpoint.find(path, config, _checkpoint_dtype(config, load_kwargs.get("dtype", "auto")))
        if checkpoint is not None:
            return config, None, checkpoint
    # Other formats, converted tensor names or loading options: transformers loads the whole model (every rank).
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **load_kwargs)
    return model.config, model, None


def causal_lm_specs(model_or_config: Any, *, seed: int = 1234,
                    load_kwargs: Mapping[str, Any] | None = None) -> list:
    """The causal LM as DeepSpeed layer specs: embedding, decoder layers, final norm, LM head.

    Args:
        model_or_config: a ``transformers`` config (weights initialised as ``transformers`` does, from
            ``seed`` and the layer index, so any stage count builds the same model); a loaded ``*ForCausalLM``
            (its modules become the pipeline's layers: weights kept, not copied; don't use the model on its own
            afterwards; every rank holds the whole model); or a local directory written by ``save_pretrained``
            (nothing is downloaded): with safetensors weights each stage reads only its own layers' tensors, in
            ``load_kwargs["dtype"]`` (default ``"auto"``: config.json's dtype, as ``from_pretrained``); other
            formats, checkpoints whose tensor names ``transformers`` converts on loading (GPT-NeoX, the
            mixtures of experts) or other ``load_kwargs`` go through ``AutoModelForCausalLM.from_pretrained(path,
            **load_kwargs)``, the whole model on every rank.

    Use with ``TokenPipelineModule(specs, num_stages=..., loss_fn=causal_lm_loss, vocab_size=config.vocab_size)``;
    batches are ``(input_ids, labels)``, labels already shifted (``ids[:, 1:]``), both (micro_batch, seq_len).
    Parameter names map to the ``transformers`` model's with :func:`hf_param_name`.
    """
    config, model, checkpoint = _load(model_or_config, load_kwargs)
    family = _check_config(config)
    attn_config = _attention_config(config)
    num_layers = config.num_hidden_layers
    if model is None:
        base = head = None
        tied = bool(getattr(config, "tie_word_embeddings", False))
    else:
        base = getattr(model, family.base, None)
        head = getattr(model, "lm_head", None)
        if base is None or head is None:
            raise UnsupportedModelError(f"causal_lm_specs needs a causal LM with an LM head ({config.model_type}: "
                                        f"the *ForCausalLM / *LMHeadModel class), got {type(model).__name__}")
        tied = head.weight is getattr(base, family.embed).weight

    def part(name: str, index: int | None = None) -> nn.Module | None:
        if base is None:
            return None
        return getattr(base, name) if index is None else getattr(base, name)[index]

    embed_attr = f"{family.embed}.weight"
    embed = dict(source=base, seed=seed, checkpoint=checkpoint)
    specs: list = []
    if tied:
        specs.append(TiedLayerSpec("embed", HFEmbedding, attn_config, tied_weight_attr=embed_attr, **embed))
    else:
        specs.append(LayerSpec(HFEmbedding, attn_config, **embed))
    specs += [LayerSpec(HFDecoderLayer, attn_config, i, source=part(family.layers, i), seed=seed,
                        checkpoint=checkpoint) for i in range(num_layers)]
    specs.append(LayerSpec(HFFinalNorm, attn_config, source=part(family.norm), checkpoint=checkpoint))
    if tied:
        specs.append(TiedLayerSpec("embed", HFEmbedding, attn_config, forward_fn=_tied_head,
                                   tied_weight_attr=embed_attr, **embed))
    else:
        specs.append(LayerSpec(HFLMHead, attn_config, source=head, seed=seed, checkpoint=checkpoint))
    return specs


def hf_param_name(pipe_name: str, config: PretrainedConfig) -> str:
    """The ``transformers`` model's name of a pipeline parameter.

    ``"3.layer.self_attn.q_proj.weight"`` -> ``"model.layers.2.self_attn.q_proj.weight"``,
    ``"tied_modules.embed.wte.weight"`` -> ``"transformer.wte.weight"``; layer 0 is the embedding, 1..N the
    decoder layers, N+1 the final norm, N+2 the LM head (``"lm_head.weight"``, or the tied embedding's names).
    """
    family = _family(config)
    num_layers = config.num_hidden_layers
    if pipe_name.startswith("tied_modules.embed."):
        return f"{family.base}.{pipe_name[len('tied_modules.embed.'):]}"
    index, _, rest = pipe_name.partition(".")
    idx = int(index)
    if 1 <= idx <= num_layers:
        return f"{family.base}.{family.layers}.{idx - 1}.{rest.removeprefix('layer.')}"
    if idx == num_layers + 2 and rest.startswith("lm_head."):
        return rest
    if idx in (0, num_layers + 1, num_layers + 2):  # embedding, final norm, the tied head's embedding
        return f"{family.base}.{rest}"
    raise ValueError(f"hf_param_name: {pipe_name!r} is not a parameter of a {num_layers}-layer "
                     f"{config.model_type} pipeline (layers 0..{num_layers + 2})")


def hf_state_dict(pipeline_state: Mapping[str, torch.Tensor], config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """A pipeline state dict (``ds_terapipe.export_state_dict(dir)``, or ``named_parameters`` of every stage)
    as the ``transformers`` model's: ``AutoModelForCausalLM.from_config(config).load_state_dict(...)`` then
    ``save_pretrained`` writes the trained model back. Tied copies collapse into one; a tied LM head gets the
    embedding (transformers lists ``lm_head.weight`` too)."""
    family = _family(config)
    head_index = f"{config.num_hidden_layers + 2}."
    out: dict[str, torch.Tensor] = {}
    # The tied head's copy of the embedding last: GPT-2's position embedding is trained on the first stage only.
    for name, tensor in sorted(pipeline_state.items(), key=lambda item: item[0].startswith(head_index)):
        out.setdefault(hf_param_name(name, config), tensor)
    embed = f"{family.base}.{family.embed}.weight"
    if "lm_head.weight" not in out and embed in out:
        out["lm_head.weight"] = out[embed]
    return out
