"""Hugging Face models (ds_terapipe.models.hf) sliced vs the transformers model's own forward/backward.

Tier a (one process): the pipeline layers built by ``causal_lm_specs`` run as 2 stages in this process, every
(micro-batch, slice) forward and backward in the order the planner's schedule gives each stage (gpipe, 1f1b),
with the engine's slice contexts and per-(stage, micro-batch) KV state; loss and every gradient must equal
``transformers``' unsliced model on the same weights (fp32, relative error <= 1e-5). Tiny configs are made
here; nothing is downloaded. Tier b: one 2-stage run through ``ds_terapipe.initialize`` (tests/suites/hf.py).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from functools import cache, partial
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")

from deepspeed.pipe import TiedLayerSpec  # noqa: E402

from ds_terapipe.models.hf import (SUPPORTED_MODEL_TYPES, UnsupportedModelError, causal_lm_loss,  # noqa: E402
                                   causal_lm_specs, hf_param_name, hf_state_dict, terapipe_attention)
from ds_terapipe.planner.schedule import ActionKind, build_schedule  # noqa: E402
from ds_terapipe.runtime.slicing.context import MicroBatchState, SliceContext, slice_scope  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
SEQ_LEN, BATCH, MICRO_BATCHES, VOCAB = 16, 2, 2, 128
SLICINGS = {"one": [16], "equal": [4, 4, 4, 4], "unequal": [3, 9, 4]}
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=VOCAB,
              max_position_embeddings=64)


def tiny_config(arch: str) -> "transformers.PretrainedConfig":
    """Tiny configs; the Llama family with grouped-query attention (4 query heads, 2 key/value heads)."""
    if arch == "llama":
        return transformers.LlamaConfig(**COMMON, num_key_value_heads=2)
    if arch == "llama-tied":
        return transformers.LlamaConfig(**COMMON, num_key_value_heads=4, tie_word_embeddings=True)
    if arch == "mistral":
        return transformers.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=None)
    if arch == "qwen2":
        return transformers.Qwen2Config(**COMMON, num_key_value_heads=2)
    if arch == "qwen3":
        return transformers.Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=32)
    if arch == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=64,
                                       bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if arch in OTHER_ARCHS:
        name, kwargs = OTHER_ARCHS[arch]
        return getattr(transformers, name)(**COMMON, **TOKENS, **kwargs)
    raise KeyError(arch)


TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary
FULL_ATTENTION = dict(sliding_window=8, layer_types=["full_attention"] * COMMON["num_hidden_layers"])
SLIDING_FULL_SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]
# Architectures beyond the Llama family, each with its quirk in play: Gemma's sqrt(hidden) embedding scale (and
# Gemma 3's per-layer-type rotary tables, local and global bases differing), partial rotary (Phi, StableLM,
# GPT-NeoX, GLM), parallel residual (GPT-NeoX, Cohere, Cohere 2), LayerNorm final norms, Granite's (and
# Granite-MoE's) multipliers and Cohere's (and Cohere 2's, tied) logit scale (not 1, so a dropped one shows), Phi's
# head bias, mixture-of-experts layers (Mixtral, Qwen3-MoE, Granite-MoE; shared experts: Qwen2-MoE, Granite-MoE-
# shared), static rope scalings (linear, YaRN, llama3, HunYuan's fixed-alpha "dynamic").
OTHER_ARCHS = {
    "gemma": ("GemmaConfig", dict(num_key_value_heads=2, head_dim=16)),
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=32,
                                    attn_logit_softcapping=None, final_logit_softcapping=None, **FULL_ATTENTION)),
    "gemma3": ("Gemma3TextConfig", dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=32,
                                        **FULL_ATTENTION)),
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                        "partial_rotary_factor": 0.5})),
    "olmo": ("OlmoConfig", dict(num_key_value_heads=2, clip_qkv=4.0)),
    "olmo2": ("Olmo2Config", dict(num_key_value_heads=2)),
    "granite": ("GraniteConfig", dict(num_key_value_heads=2, embedding_multiplier=3.0, logits_scaling=4.0,
                                      residual_multiplier=0.5, attention_multiplier=0.2)),
    "cohere": ("CohereConfig", dict(num_key_value_heads=2, logit_scale=0.25, use_qk_norm=True)),
    "smollm3": ("SmolLM3Config", dict(num_key_value_heads=2, no_rope_layers=[1, 0, 1])),
    "stablelm": ("StableLmConfig", dict(num_key_value_heads=2, use_qkv_bias=True)),
    "starcoder2": ("Starcoder2Config", dict(num_key_value_heads=2, residual_dropout=0.0, embedding_dropout=0.0)),
    "phi": ("PhiConfig", dict(num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0)),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_dropout=0.0, attention_dropout=0.0)),
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[2])),
    "glm": ("GlmConfig", dict(num_key_value_heads=2, head_dim=16)),  # interleaved partial rotary, q/k/v biases
    "glm4": ("Glm4Config", dict(num_key_value_heads=2, head_dim=16)),  # plus norms after attention and MLP
    "helium": ("HeliumConfig", dict(num_key_value_heads=2, head_dim=16)),
    "ministral": ("MinistralConfig", dict(num_key_value_heads=2, head_dim=16, **FULL_ATTENTION)),
    # a rotary table per layer type: the full layers' (linear scaling, another base) is the one in play
    "olmo3": ("Olmo3Config", dict(num_key_value_heads=2, **FULL_ATTENTION, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # no window: every layer applies rotary (with one set, the full layers apply none)
    "exaone4": ("Exaone4Config", dict(num_key_value_heads=2, sliding_window=None,
                                      layer_types=["full_attention"] * COMMON["num_hidden_layers"])),
    "seed_oss": ("SeedOssConfig", dict(num_key_value_heads=2, head_dim=16, attention_out_bias=True,
                                       attention_dropout=0.0, residual_dropout=0.0)),
    "arcee": ("ArceeConfig", dict(num_key_value_heads=2, rope_parameters={  # ReLU^2 MLP, YaRN rotary
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "rope_theta": 1e4})),
    "apertus": ("ApertusConfig", dict(num_key_value_heads=2)),  # xIELU MLP (trained scalars), llama3 rotary
    # HunYuan's "dynamic" with a fixed alpha is a static base stretch (its rotary runs it as "ntk_alpha")
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(num_key_value_heads=2, head_dim=16, rope_parameters={
        "rope_type": "dynamic", "factor": 1.0, "alpha": 1000.0, "rope_theta": 1e4})),
    "cohere2": ("Cohere2Config", dict(num_key_value_heads=2, logit_scale=0.25, **FULL_ATTENTION)),  # tied head
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                         norm_topk_prob=True, mlp_only_layers=[1])),  # a gated shared expert
    "granitemoe": ("GraniteMoeConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                            embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5,
                                            attention_multiplier=0.2)),
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(num_key_value_heads=2, num_local_experts=4,
                                                        num_experts_per_tok=2, shared_intermediate_size=48,
                                                        embedding_multiplier=3.0, logits_scaling=4.0,
                                                        residual_multiplier=0.5, attention_multiplier=0.2)),
    # mixtures of experts (a few experts, each type's dense and shared-expert layers in play)
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(num_key_value_heads=2, head_dim=16, num_experts=4, moe_topk=2)),
    "olmoe": ("OlmoeConfig", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)),
    "flex_olmo": ("FlexOlmoConfig", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)),
    "glm4_moe": ("Glm4MoeConfig", dict(num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                                       use_qk_norm=True, routed_scaling_factor=2.5)),  # partial rotary
    "ernie4_5": ("Ernie4_5Config", dict(num_key_value_heads=2, head_dim=16, use_bias=True)),  # tied head
    # an untied head with a bias (use_bias); a frozen routing-correction bias
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(num_key_value_heads=2, moe_num_experts=4, moe_k=2,
                                                moe_intermediate_size=32, moe_num_shared_experts=1, use_bias=True,
                                                tie_word_embeddings=False)),
    "nemotron": ("NemotronConfig", dict(num_key_value_heads=2, head_dim=16)),  # LayerNorm1P, partial rotary
    "minimax_m2": ("MiniMaxM2Config", dict(num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                           num_experts_per_tok=2)),
    "solar_open": ("SolarOpenConfig", dict(num_key_value_heads=2, head_dim=16, n_routed_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)),
    "bitnet": ("BitNetConfig", dict(num_key_value_heads=2)),
    "jetmoe": ("JetMoeConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                    kv_channels=16)),  # attention experts too; tied head
    "jais2": ("Jais2Config", dict(num_key_value_heads=2, head_dim=16)),  # LayerNorm final norm
    "hyperclovax": ("HyperCLOVAXConfig", dict(num_key_value_heads=2, head_dim=16, embedding_multiplier=3.0,
                                              logits_scaling=0.25, residual_multiplier=0.5, attention_multiplier=0.2)),
    # a weightless RMSNorm before the layers and as the final norm, a final-logit cap the logits reach
    "nanochat": ("NanoChatConfig", dict(num_key_value_heads=2, final_logit_softcapping=0.3)),
    "persimmon": ("PersimmonConfig", dict(hidden_dropout=0.0)),  # LayerNorm final_layernorm, partial rotary
    "hy_v3": ("HYV3Config", dict(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, num_shared_experts=1,
                                 mlp_layer_types=["dense", "sparse", "sparse"])),
    "aria_text": ("AriaTextConfig", dict(num_key_value_heads=2, head_dim=16, moe_num_experts=4, moe_topk=2,
                                         moe_num_shared_experts=1)),
    # windows of 5 on every layer, or on the sliding layers of layer_types, with the type's other quirks in play:
    # Phi-MoE's LayerNorm final norm and head bias, Ministral 3's position-dependent query scale (llama_4_scaling),
    # VaultGemma's sqrt(hidden) embedding scale and caps, AFMoE's muP embedding scale, Mellum's rotary per layer type
    "phimoe": ("PhimoeConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                    router_jitter_noise=0.0, sliding_window=5, lm_head_bias=True)),
    "ministral3": ("Ministral3Config", dict(num_key_value_heads=2, head_dim=16, sliding_window=5, rope_parameters={
        "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4, "rope_theta": 1e4,
        "llama_4_scaling_beta": 0.5})),
    "vaultgemma": ("VaultGemmaConfig", dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=32,
                                            sliding_window=5, layer_types=SLIDING_FULL_SLIDING,
                                            attn_logit_softcapping=0.05, final_logit_softcapping=0.3)),
    "dots1": ("Dots1Config", dict(num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                                  sliding_window=5, layer_types=SLIDING_FULL_SLIDING)),
    "exaone_moe": ("ExaoneMoeConfig", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, num_shared_experts=1, first_k_dense_replace=1,
                                           sliding_window=5, layer_types=SLIDING_FULL_SLIDING)),
    "afmoe": ("AfmoeConfig", dict(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, num_shared_experts=1, num_dense_layers=1, mup_enabled=True,
                                  sliding_window=5, layer_types=SLIDING_FULL_SLIDING)),
    "mellum": ("MellumConfig", dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, sliding_window=5, layer_types=SLIDING_FULL_SLIDING,
                                    rope_parameters={
                                        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "cwm": ("CwmConfig", dict(num_key_value_heads=2, head_dim=16, sliding_window=5, layer_types=SLIDING_FULL_SLIDING)),
    "kolibri1": ("Kolibri1Config", dict(num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=48, sliding_window=5,
                                        layer_types=SLIDING_FULL_SLIDING)),
    # Attention sinks: Granite SWA's on every layer (sliding and full), with a rotary base per layer and a layer
    # without rotary (theta 0), and Granite's multipliers; MiMo-V2-Flash's on the sliding layers, values narrower
    # than keys, a rotary table per layer type
    "granite_swa": ("GraniteSWAConfig", dict(num_key_value_heads=2, embedding_multiplier=3.0, logits_scaling=4.0,
                                             residual_multiplier=0.5, attention_multiplier=0.2, sliding_window=5,
                                             layer_types=SLIDING_FULL_SLIDING, layer_rope_theta=[1e4, 0, 5e5])),
    "granitemoe_swa": ("GraniteMoeSWAConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                                   embedding_multiplier=3.0, logits_scaling=4.0,
                                                   residual_multiplier=0.5, attention_multiplier=0.2,
                                                   sliding_window=5, layer_types=SLIDING_FULL_SLIDING,
                                                   layer_rope_theta=[5e5, 1e4, 0])),
    "mimo_v2_flash": ("MiMoV2FlashConfig", dict(num_key_value_heads=2, head_dim=16, v_head_dim=12, n_routed_experts=4,
                                                num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=5,
                                                layer_types=SLIDING_FULL_SLIDING,
                                                mlp_layer_types=["dense", "sparse", "sparse"])),
    # latent attention (keys of 16 + 8 dims, values of 12): Youtu's dense, GLM-4-MoE-Lite's and Sarvam's experts,
    # MiniCPM3's embedding scale, residual scale and hidden states scaled down before its (tied) head
    "youtu": ("YoutuConfig", dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                  qk_rope_head_dim=8, v_head_dim=12)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                                                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                                                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                mlp_layer_types=["dense", "sparse", "sparse"])),
    "sarvam_mla": ("SarvamMLAConfig", dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)),
    "minicpm3": ("MiniCPM3Config", dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=12, scale_emb=3.0, dim_model_base=16)),
    # Cohere 2-MoE's final norm: an RMSNorm with rms_norm_eps set (the example trainer's default config: LayerNorm)
    "cohere2_moe": ("Cohere2MoeConfig", dict(num_key_value_heads=2, head_dim=16, logit_scale=0.25, num_experts=4,
                                             num_experts_per_tok=2, sliding_window=5, layer_types=SLIDING_FULL_SLIDING,
                                             rms_norm_eps=1e-6)),
    # Laguna: a softplus gate per head on the attention's output, a head count per layer
    "laguna": ("LagunaConfig", dict(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, shared_expert_intermediate_size=48, sliding_window=5,
                                    layer_types=SLIDING_FULL_SLIDING, num_attention_heads_per_layer=[4, 8, 4])),
    "apertus1p5_text": ("Apertus1p5TextConfig", dict(num_key_value_heads=2)),
    # multimodal rotary sections (one position per text token on every axis), no rotary on the full layers
    "cohere_compass_text": ("CohereCompassTextConfig", dict(num_key_value_heads=2, sliding_window=5,
                                                            layer_types=SLIDING_FULL_SLIDING, rope_parameters={
                                                                "sliding_attention": {"rope_type": "default",
                                                                                      "rope_theta": 1e4,
                                                                                      "mrope_section": [2, 3, 3]},
                                                                "full_attention": None})),
    # DBRX: q/k/v clipped at 0.2 (a fifth of the tiny model's are larger), 4 experts under a top-2 router, 2 key/value
    # heads; d_model set too (the experts' width follows it, not hidden_size), rope_theta (its attention reads it)
    "dbrx": ("DbrxConfig", dict(d_model=64, attn_config=dict(kv_n_heads=2, clip_qkv=0.2, rope_theta=1e4),
                                ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2))),
    # Sliding windows shorter than the sequence (5 of its 16 keys): the slicings cut slices shorter and longer
    # than the window. Mistral's on every layer; the others' on the 'sliding_attention' layers of layer_types, with
    # what else the type picks in play: Gemma 3's local rotary base, Cohere 2's and EXAONE 4's rotary on sliding
    # layers only, Qwen2-MoE's attention that passes no sliding_window (its mask alone says it).
    "mistral-window": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=5)),
    "qwen2-window": ("Qwen2Config", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
                                         max_window_layers=1)),   # layers 1 and 2 slide
    "gemma2-window": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=32,
                                           attn_logit_softcapping=None, final_logit_softcapping=None,
                                           sliding_window=5)),   # layers 0 and 2 slide
    # Softcapping (attn_logit_softcapping, final_logit_softcapping) with a window of 5: Gemma 2's defaults (50,
    # 30), and caps near the tiny model's largest scores (~0.09) and logits (~0.6), so that a dropped or misplaced
    # cap shows. Gemma 3 caps its logits only (its attention passes no softcap, so the attention cap is inert).
    "gemma2-softcap": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=32,
                                            sliding_window=5)),
    "gemma2-softcap-tight": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=32,
                                                  sliding_window=5, attn_logit_softcapping=0.05,
                                                  final_logit_softcapping=0.3)),
    "gemma3-softcap-tight": ("Gemma3TextConfig", dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=32,
                                                      sliding_window=5, layer_types=SLIDING_FULL_SLIDING,
                                                      attn_logit_softcapping=0.05, final_logit_softcapping=0.3)),
    # Attention sinks (a learned logit per head in every softmax's denominator) on sliding (window 5) and full
    # layers, a mixture of experts with biases, YaRN rotary.
    "gpt_oss": ("GptOssConfig", dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=5, layer_types=SLIDING_FULL_SLIDING, rope_parameters={
                                         "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                                         "rope_theta": 1e4, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})),
    # Multi-head latent attention: keys of 16 + 8 dims, values of 12; a dense first layer, then experts routed within
    # groups per token (V3: 8 experts in 4 groups, 2 groups kept), a shared expert; q_lora_rank set and None, rotary
    # interleaved and not (and YaRN's mscale in the attention scale).
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                                             n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                             n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1)),
    "deepseek_v3-no-q-lora": ("DeepseekV3Config", dict(
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1, rope_interleave=False, rope_parameters={
            "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "rope_theta": 1e4,
            "mscale": 1.0, "mscale_all_dim": 1.0})),
    "deepseek_v2": ("DeepseekV2Config", dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                                             n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                             topk_method="group_limited_greedy", n_shared_experts=1,
                                             moe_intermediate_size=32, first_k_dense_replace=1)),
    "gemma3-window": ("Gemma3TextConfig", dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=32,
                                               sliding_window=5, layer_types=SLIDING_FULL_SLIDING)),
    "cohere2-window": ("Cohere2Config", dict(num_key_value_heads=2, logit_scale=0.25, sliding_window=5,
                                             layer_types=SLIDING_FULL_SLIDING)),
    "exaone4-window": ("Exaone4Config", dict(num_key_value_heads=2, sliding_window=5,
                                             layer_types=SLIDING_FULL_SLIDING)),
    "qwen2_moe-window": ("Qwen2MoeConfig", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                use_sliding_window=True, sliding_window=5, max_window_layers=3)),
    # Llama 4: chunked attention (chunks of 5 over 16 tokens) on its RoPE layers 0 and 2, a NoPE full-attention layer
    # 1 with temperature tuning that moves every few tokens (floor_scale 2), query/key L2 norms, llama3 rotary; a
    # shared expert plus 4 experts under a sigmoid top-2 router on layers 0 and 2, a dense MLP on layer 1.
    "llama4_text": ("Llama4TextConfig", dict(num_key_value_heads=2, head_dim=16, attention_chunk_size=5,
                                             no_rope_layers=[1, 0, 1], attn_temperature_tuning=True, floor_scale=2,
                                             attn_scale=0.5, num_local_experts=4, num_experts_per_tok=2,
                                             moe_layers=[0, 2], intermediate_size_mlp=96, rope_parameters={
                                                 "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8,
                                                 "rope_theta": 5e5})),
}
# the model types listed by name above, from "hunyuan_v1_moe" on
NEW_ARCHS = list(OTHER_ARCHS)[list(OTHER_ARCHS).index("hunyuan_v1_moe"):list(OTHER_ARCHS).index("mistral-window")]
CAUSAL_LM_CLASSES = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
ARCHS = ["llama", "llama-tied", "mistral", "qwen2", "qwen3", "gpt2", *OTHER_ARCHS]
MODEL_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama-tied": "LlamaForCausalLM", "llama": "LlamaForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "olmo": "OlmoForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "granite": "GraniteForCausalLM", "cohere": "CohereForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                 "stablelm": "StableLmForCausalLM", "starcoder2": "Starcoder2ForCausalLM", "phi": "PhiForCausalLM",
                 "gpt_neox": "GPTNeoXForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM",
                 "helium": "HeliumForCausalLM", "ministral": "MinistralForCausalLM", "olmo3": "Olmo3ForCausalLM",
                 "exaone4": "Exaone4ForCausalLM", "seed_oss": "SeedOssForCausalLM", "arcee": "ArceeForCausalLM",
                 "apertus": "ApertusForCausalLM", "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
                 "cohere2": "Cohere2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "granitemoe": "GraniteMoeForCausalLM", "granitemoeshared": "GraniteMoeSharedForCausalLM",
                 "gpt_oss": "GptOssForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "deepseek_v2": "DeepseekV2ForCausalLM"}
MODEL_CLASSES.update({arch: CAUSAL_LM_CLASSES[arch] for arch in (*NEW_ARCHS, "llama4_text")})
MODEL_CLASSES.update({arch: MODEL_CLASSES[arch.split("-")[0]] for arch in OTHER_ARCHS if "-" in arch})


def hf_model(arch: str, seed: int = 0) -> "transformers.PreTrainedModel":
    torch.manual_seed(seed)
    config = tiny_config(arch)
    config._attn_implementation = "eager"  # the reference: transformers' own attention, not SDPA
    return getattr(transformers, MODEL_CLASSES[arch])(config).eval()


def make_batches(seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (MICRO_BATCHES, BATCH, SEQ_LEN + 1), generator=gen)
    return [(ids[b, :, :-1], ids[b, :, 1:]) for b in range(MICRO_BATCHES)]


def build_stages(specs: list, num_stages: int) -> tuple[list[list], dict[str, torch.nn.Parameter]]:
    """Build the specs as PipelineModule does (a tied module once, shared), cut into contiguous stages.

    Returns each stage's callables and the parameters named as the pipeline module names them.
    """
    tied: dict[str, torch.nn.Module] = {}
    calls, params = [], {}
    for index, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
                params.update({f"tied_modules.{spec.key}.{n}": p for n, p in tied[spec.key].named_parameters()})
            module = tied[spec.key]
            calls.append(partial(spec.forward_fn, module) if spec.forward_fn else module)
        else:
            module = spec.build()
            params.update({f"{index}.{n}": p for n, p in module.named_parameters()})
            calls.append(module)
    per_stage = -(-len(calls) // num_stages)
    return [calls[s * per_stage:(s + 1) * per_stage] for s in range(num_stages)], params


def run_sliced(stages: list[list], batches: list, slices: list[int], schedule: str) -> tuple[float, list]:
    """Every stage's actions of ``schedule`` in a dependency-respecting order, one graph per (stage, unit).

    Returns the loss (the engine's weighting: slice i by len_i / seq_len, micro-batches averaged) and the
    MicroBatchStates (for the KV-cache checks).
    """
    num_stages, num_micro = len(stages), len(batches)
    plan = build_schedule(schedule, num_stages, num_micro, len(slices))
    bounds = [sum(slices[:i]) for i in range(len(slices) + 1)]
    states = [[MicroBatchState(b, SEQ_LEN, len(slices)) for b in range(num_micro)] for _ in range(num_stages)]
    inputs, outputs, done = {}, {}, set()
    pointers, total = [0] * num_stages, 0.0
    while any(p < len(stream) for p, stream in zip(pointers, plan.stages)):
        progressed = False
        for s, stream in enumerate(plan.stages):
            if pointers[s] == len(stream):
                continue
            action = stream[pointers[s]]
            b, i = action.microbatch, action.slice
            start, end = bounds[i], bounds[i + 1]
            if action.kind is ActionKind.FORWARD:
                if s > 0 and (s - 1, "F", b, i) not in done:
                    continue
                x = batches[b][0][:, start:end] if s == 0 else outputs[(s - 1, b, i)].detach().requires_grad_()
                inputs[(s, b, i)] = x
                with slice_scope(SliceContext(b, i, start, end, states[s][b])):
                    for layer in stages[s]:
                        x = layer(x)
                if s == num_stages - 1:
                    x = causal_lm_loss(x, batches[b][1][:, start:end]) * (end - start) / SEQ_LEN / num_micro
                    total += float(x.detach())
                outputs[(s, b, i)] = x
                done.add((s, "F", b, i))
            elif action.kind is ActionKind.BACKWARD:
                if s < num_stages - 1 and (s + 1, "B", b, i) not in done:
                    continue
                if s == num_stages - 1:
                    outputs[(s, b, i)].backward()
                else:
                    outputs[(s, b, i)].backward(inputs[(s + 1, b, i)].grad)
                done.add((s, "B", b, i))
            pointers[s] += 1
            progressed = True
        assert progressed, f"schedule {schedule} stalled at {pointers}"
    return total, states


def reference(model, batches: list) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = sum(causal_lm_loss(model(input_ids=x).logits, y) for x, y in batches) / len(batches)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@cache
def model_and_reference(arch: str) -> tuple["transformers.PreTrainedModel", float, dict[str, torch.Tensor]]:
    """``hf_model(arch)`` and its ``reference`` on ``make_batches()``, once per architecture for the slicings and
    schedules that compare with them (a fifth of the module's time). The model is left without gradients and is
    never trained: a test builds its stages from a copy."""
    model = hf_model(arch)
    ref_loss, ref_grads = reference(model, make_batches())
    model.zero_grad(set_to_none=True)
    return model, ref_loss, ref_grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


def compare(params: dict, ref_grads: dict, config) -> tuple[float, str]:
    """Worst relative gradient error over every trained transformers parameter (each must have a pipeline twin; a
    frozen one, ERNIE 4.5-MoE's routing-correction bias, must be frozen there too)."""
    got = {hf_param_name(n, config): p for n, p in params.items() if p.requires_grad}
    assert set(got) == set(ref_grads), (set(got) ^ set(ref_grads))
    worst, worst_name = 0.0, ""
    for name, ref in ref_grads.items():
        grad = got[name].grad
        assert grad is not None, f"{name} got no gradient"
        err = rel_err(grad, ref)
        if err >= worst:
            worst, worst_name = err, name
    return worst, worst_name


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("slicing", list(SLICINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_sliced_equals_transformers(arch: str, slicing: str, schedule: str) -> None:
    """A loaded model's weights (kept), 2 in-process stages, 2 micro-batches: loss and every gradient."""
    model, ref_loss, ref_grads = model_and_reference(arch)
    stages, params = build_stages(causal_lm_specs(copy.deepcopy(model)), num_stages=2)
    loss, _ = run_sliced(stages, make_batches(), SLICINGS[slicing], schedule)
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (loss, ref_loss)
    worst, name = compare(params, ref_grads, model.config)
    assert worst <= TOL, f"{arch} {slicing} {schedule}: gradient of {name} off by {worst:.2e}"


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_compiled_layers_equal_transformers_without_compiling_per_slice(arch: str) -> None:
    """Every pipeline layer under ``torch.compile`` (backend ``aot_eager``: dynamo and AOT autograd; what
    ``engine.compile()`` does per chunk), 2 stages, 1f1b over slices [3, 9, 4], [4, 4, 4, 4], then 8 x 2: the loss
    and every gradient equal ``transformers``' within 1e-5, and once lengths are dynamic, slices at new offsets
    compile nothing (the last slicing no graph): neither the slice's offset (its positions) nor the sliced attention
    is traced into a graph."""
    from torch._dynamo.utils import counters
    model = hf_model(arch)
    ref_loss, ref_grads = reference(model, make_batches())
    torch._dynamo.reset()
    for slices in (SLICINGS["unequal"], SLICINGS["equal"], [2] * 8):
        stages, params = build_stages(causal_lm_specs(copy.deepcopy(model)), num_stages=2)
        stages = [[torch.compile(layer, backend="aot_eager") if isinstance(layer, torch.nn.Module) else layer
                   for layer in stage] for stage in stages]
        graphs = counters["stats"]["unique_graphs"]
        loss, _ = run_sliced(stages, make_batches(), slices, "1f1b")
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (slices, loss, ref_loss)
        worst, name = compare(params, ref_grads, model.config)
        assert worst <= TOL, f"{arch} {slices} compiled: gradient of {name} off by {worst:.2e}"
    assert counters["stats"]["unique_graphs"] == graphs, "slices at new offsets compiled again"


@pytest.mark.parametrize("arch", ARCHS)
def test_from_config_is_deterministic_and_exact(arch: str) -> None:
    """From a config: seeded transformers-style init, the same for any stage count; equal to transformers on
    the same weights."""
    config = tiny_config(arch)
    stages, params = build_stages(causal_lm_specs(config, seed=3), num_stages=2)
    _, again = build_stages(causal_lm_specs(config, seed=3), num_stages=1)
    assert all(torch.equal(p, again[n]) for n, p in params.items())
    weights = {hf_param_name(n, config): p.detach() for n, p in params.items()}
    model = hf_model(arch, seed=99)
    for name, param in model.named_parameters():   # attention sinks: zero where transformers builds them zero
        if name.endswith("sinks"):
            assert bool((weights[name] == 0).all()) == bool((param == 0).all()), name
    missing = model.load_state_dict(weights, strict=False)
    # only what is no parameter of its own: a tied head, persistent buffers (Apertus' xIELU constants)
    assert set(missing.missing_keys) == set(model.state_dict()) - set(dict(model.named_parameters())), missing
    assert not missing.unexpected_keys, missing
    std = max((p for n, p in weights.items() if ".0." in n and n.endswith("weight")), key=torch.numel).std()
    assert 0.5 * config.initializer_range < float(std) < 1.5 * config.initializer_range  # transformers-style init
    ref_loss, ref_grads = reference(model, make_batches())
    loss, _ = run_sliced(stages, make_batches(), SLICINGS["unequal"], "1f1b")
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    worst, name = compare(params, ref_grads, config)
    assert worst <= TOL, f"{arch}: gradient of {name} off by {worst:.2e}"


def test_grouped_query_cache_holds_only_kv_heads() -> None:
    """Llama with 4 query / 2 key-value heads: the KV buffers hold 2 heads' worth, not 4 (no repeated K/V)."""
    model = hf_model("llama")
    config = model.config
    stages, _ = build_stages(causal_lm_specs(copy.deepcopy(model)), num_stages=1)
    with torch.no_grad():
        logits, states = run_sliced_forward_only(stages[0], make_batches()[0][0], SLICINGS["unequal"])
        logits_ref = model(input_ids=make_batches()[0][0]).logits
    head_dim = config.hidden_size // config.num_attention_heads
    per_layer = 2 * BATCH * config.num_key_value_heads * SEQ_LEN * head_dim * 4  # k and v, fp32
    assert states.nbytes() == config.num_hidden_layers * per_layer
    assert rel_err(logits, logits_ref) <= TOL


@pytest.mark.parametrize("arch, shard, dtype", [("llama", None, torch.float32), ("gpt2", "100KB", torch.float32),
                                                 ("qwen3", None, torch.bfloat16), ("gemma", None, torch.bfloat16),
                                                 ("phi", "100KB", torch.float32), ("cohere", None, torch.float32),
                                                 ("gpt_neox", None, torch.float32), ("mixtral", None, torch.float32),
                                                 ("glm", None, torch.float32), ("glm4", "100KB", torch.float32),
                                                 ("helium", None, torch.bfloat16), ("ministral", None, torch.float32),
                                                 ("olmo3", None, torch.float32), ("exaone4", None, torch.float32),
                                                 ("seed_oss", None, torch.float32), ("arcee", None, torch.float32),
                                                 ("apertus", None, torch.float32),
                                                 ("hunyuan_v1_dense", None, torch.float32),
                                                 ("cohere2", "100KB", torch.float32),
                                                 ("qwen2_moe", None, torch.float32),
                                                 ("granitemoe", None, torch.float32),
                                                 ("granitemoeshared", None, torch.bfloat16),
                                                 *((arch, None, torch.float32) for arch in (
                                                     "mistral", "qwen2", "gemma2", "gemma3", "phi3", "olmo",
                                                     "olmo2", "granite", "smollm3", "stablelm", "starcoder2",
                                                     "qwen3_moe", "gpt_oss", "deepseek_v3", *NEW_ARCHS,
                                                     "llama4_text"))])
def test_local_directory_loads_each_layer_from_safetensors(arch: str, shard, dtype, tmp_path) -> None:
    """A save_pretrained directory (one file, or sharded with an index): every layer reads its own tensors,
    in config.json's dtype; weights and outputs equal the saved model's. GPT-NeoX's and the mixture-of-experts
    checkpoints hold other names than the modules (transformers converts them on loading): from_pretrained
    reads those."""
    model = hf_model(arch).to(dtype)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    stages, params = build_stages(causal_lm_specs(tmp_path), num_stages=1)
    saved = dict(model.named_parameters())
    for name, param in params.items():
        assert param.dtype == dtype and torch.equal(param, saved[hf_param_name(name, model.config)]), name
    with torch.no_grad():
        logits, _ = run_sliced_forward_only(stages[0], make_batches()[0][0], SLICINGS["unequal"])
        logits_ref = model(input_ids=make_batches()[0][0]).logits
    assert rel_err(logits.float(), logits_ref.float()) <= (TOL if dtype == torch.float32 else 1e-2)


def test_a_converted_checkpoint_without_architectures_in_its_config_loads_through_transformers(tmp_path) -> None:
    """GPT-NeoX's renaming (embed_out -> lm_head) is registered under its causal LM class alone: a config.json
    without "architectures" is still recognised as one and read by from_pretrained, not by the per-layer reader."""
    model = hf_model("gpt_neox")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("architectures", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, params = build_stages(causal_lm_specs(tmp_path), num_stages=1)
    saved = dict(model.named_parameters())
    assert all(torch.equal(param, saved[hf_param_name(name, model.config)]) for name, param in params.items())


@pytest.mark.parametrize("arch", ["llama", "llama-tied", "gpt2", "gemma", "phi", "gpt_neox", "mixtral", "glm", "glm4",
                                  "helium", "ministral", "olmo3", "exaone4", "seed_oss", "arcee", "apertus",
                                  "hunyuan_v1_dense", "cohere2", "qwen2_moe", "granitemoe", "granitemoeshared",
                                  "mistral", "qwen2", "qwen3", "cohere", "gemma2", "gemma3", "phi3", "olmo", "olmo2",
                                  "granite", "smollm3", "stablelm", "starcoder2", "qwen3_moe", "gpt_oss",
                                  "deepseek_v3", "deepseek_v2", *NEW_ARCHS, "llama4_text"])
def test_exported_pipeline_weights_load_into_transformers(arch: str) -> None:
    """export_state_dict's layout ("<layer>.<param>", a tied layer under each index that uses it) maps back to
    the transformers model: strict load, same weights."""
    config = tiny_config(arch)
    specs = causal_lm_specs(config, seed=2)
    head = f"{config.num_hidden_layers + 2}."
    exported = {}
    for index, spec in reversed(list(enumerate(specs))):  # the head first: a dict's order must not matter
        module = spec.build()
        exported.update({f"{index}.{n}": p.detach() for n, p in module.state_dict().items()})
    if arch == "gpt2":  # the last stage's copy of the position embedding is never trained
        exported[f"{head}wpe.weight"] = torch.zeros_like(exported["0.wpe.weight"])
    model = hf_model(arch, seed=42)
    model.load_state_dict(hf_state_dict(exported, config), strict=True)
    for name, param in model.named_parameters():
        sources = [k for k in exported if hf_param_name(k, config) == name]
        source = next((k for k in sources if not k.startswith(head)), sources[0])
        assert torch.equal(param, exported[source]), name


@pytest.mark.parametrize("arch", SUPPORTED_MODEL_TYPES)
def test_example_trainer_builds_every_arch_exactly(arch: str, monkeypatch) -> None:
    """examples/train_hf.py --arch, every supported model type at the trainer's default sizes (4 layers, hidden
    128, 4 heads, 2 key/value heads): the config is accepted, and the sliced forward equals transformers' on the
    same weights."""
    spec = importlib.util.spec_from_file_location("train_hf_example", ROOT / "examples" / "train_hf.py")
    train_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_hf)
    monkeypatch.setattr(sys, "argv", ["train_hf.py", "--deepspeed_config", "unused.json", "--arch", arch])
    config = train_hf.model_config(train_hf.parse_args(), vocab=256, seq_len=SEQ_LEN)
    stages, params = build_stages(causal_lm_specs(config), num_stages=1)
    for call in stages[0]:
        (call.args[0] if isinstance(call, partial) else call).eval()  # dropout off (GPT-2, Seed-OSS default 0.1)
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.load_state_dict({hf_param_name(n, config): p for n, p in params.items()}, strict=False)
    ids = make_batches()[0][0]
    with torch.no_grad():
        logits, _ = run_sliced_forward_only(stages[0], ids, SLICINGS["unequal"])
        assert rel_err(logits, model(input_ids=ids).logits) <= TOL


def run_sliced_forward_only(layers: list, ids: torch.Tensor, slices: list[int]):
    state = MicroBatchState(0, SEQ_LEN, len(slices))
    outs, start = [], 0
    for i, length in enumerate(slices):
        x = ids[:, start:start + length]
        with slice_scope(SliceContext(0, i, start, start + length, state)):
            for layer in layers:
                x = layer(x)
        outs.append(x)
        start += length
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("make, feature, fix", [
    (lambda: transformers.Gemma2Config(**COMMON, attn_logit_softcapping=None, final_logit_softcapping=None,
                                       sliding_window=None),
     "2 of 3 layers use sliding-window attention but sliding_window=None", "make those layers 'full_attention'"),
    (lambda: transformers.Qwen2Config(**COMMON, layer_types=["chunked_attention"] + ["full_attention"] * 2),
     "other attention types (chunked_attention) are not supported", "'full_attention' or 'sliding_attention'"),
    (lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, add_cross_attention=True),
     "cross-attention", "add_cross_attention=False"),
    (lambda: transformers.T5Config(), "encoder-decoder", "decoder-only"),
    (lambda: transformers.LlamaConfig(**COMMON, use_bidirectional_attention=True), "non-causal", "causal LM"),
    (lambda: transformers.BertConfig(), "'bert' is not supported", "supported: llama"),
    (lambda: transformers.LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                 "rope_theta": 10000.0}),
     "rope_type 'dynamic'", "static rope type"),
    (lambda: transformers.Gemma3TextConfig(**COMMON, **FULL_ATTENTION, rope_parameters={
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "rope_type 'dynamic'", "static rope type"),
    (lambda: transformers.MixtralConfig(**COMMON, output_router_logits=True), "load-balancing",
     "output_router_logits=False"),
    (lambda: transformers.GraniteMoeConfig(**COMMON, output_router_logits=True), "load-balancing",
     "output_router_logits=False"),
    (lambda: transformers.Qwen2MoeConfig(**COMMON, output_router_logits=True), "load-balancing",
     "output_router_logits=False"),
    (lambda: transformers.HunYuanDenseV1Config(**COMMON, head_dim=16, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope_type 'dynamic'", "static rope type"),
    # attention computed inside their layers, not through transformers' AttentionInterface: the reason is named
    (lambda: transformers.BloomConfig(n_layer=2, hidden_size=64, n_head=4),
     "'bloom' is not supported by ds_terapipe.models.hf (", "ALiBi"),
    (lambda: transformers.FalconConfig(**COMMON), "'falcon' is not supported by ds_terapipe.models.hf (",
     "AttentionInterface"),
    (lambda: transformers.Lfm2Config(**COMMON), "'lfm2' is not supported by ds_terapipe.models.hf (",
     "convolution layers carry a state along the sequence"),
    (lambda: transformers.DeepseekV32Config(**COMMON), "'deepseek_v32' is not supported", "top index_topk keys"),
    (lambda: transformers.GlmMoeDsaConfig(**COMMON), "'glm_moe_dsa' is not supported", "top index_topk keys"),
    (lambda: transformers.ZayaConfig(**COMMON), "'zaya' is not supported", "carry a state along the sequence"),
    (lambda: transformers.Llama4TextConfig(**COMMON, layer_types=["sliding_attention"] + ["full_attention"] * 2),
     "other attention types (sliding_attention) are not supported", "'full_attention' or 'chunked_attention'"),
    (lambda: transformers.Llama4TextConfig(**COMMON, attention_chunk_size=None,
                                           layer_types=["chunked_attention"] + ["full_attention"] * 2),
     "1 of 3 layers use chunked attention but attention_chunk_size=None", "make those layers 'full_attention'"),
    (lambda: transformers.Llama4TextConfig(**COMMON, attention_chunk_size=0,
                                           layer_types=["chunked_attention"] + ["full_attention"] * 2),
     "1 of 3 layers use chunked attention but attention_chunk_size=0", "(a positive int: the tokens of a chunk)"),
    # what transformers' DBRX blocks cannot build or run (test_dbrx_refusals_are_transformers_own)
    (lambda: transformers.DbrxConfig(hidden_size=64, n_heads=4, attn_config=dict(clip_qkv=8.0, rope_theta=1e4)),
     "dbrx: ffn_config.hidden_size=2048 differs from d_model=64", "with d_model=... instead of hidden_size"),
    (lambda: transformers.DbrxConfig(**DBRX_SIZES, attn_config=dict(clip_qkv=None, rope_theta=1e4)),
     "dbrx: attn_config.clip_qkv=None", "set attn_config's clip_qkv to a positive number"),
    (lambda: transformers.DbrxConfig(**DBRX_SIZES, attn_config=dict(clip_qkv=8.0)),
     "dbrx: attn_config has no rope_theta", "'rope_theta': <rope_parameters' rope_theta>"),
])
def test_unsupported_features_are_refused_when_building(make, feature: str, fix: str) -> None:
    with pytest.raises(UnsupportedModelError) as err:
        causal_lm_specs(make())
    assert feature in str(err.value) and fix in str(err.value), str(err.value)


DBRX_SIZES = dict(d_model=64, n_layers=1, n_heads=4, vocab_size=VOCAB, ffn_config=dict(ffn_hidden_size=8))


@pytest.mark.parametrize("kwargs, error", [
    (dict(DBRX_SIZES, attn_config=dict(clip_qkv=None, rope_theta=1e4)), "'min' or 'max' must not be None"),
    (dict(DBRX_SIZES, attn_config=dict(clip_qkv=8.0)), "no attribute 'rope_theta'"),
    (dict(DBRX_SIZES, d_model=2048, hidden_size=64, attn_config=dict(clip_qkv=8.0, rope_theta=1e4)),
     "cannot be multiplied"),
], ids=["clip_qkv-none", "no-rope_theta", "hidden_size"])
def test_dbrx_refusals_are_transformers_own(kwargs: dict, error: str) -> None:
    """The DBRX configs refused above fail in transformers' own model too (built, or at its first forward): when
    transformers runs one, this test fails, and its refusal should go."""
    config = transformers.DbrxConfig(**kwargs)
    with pytest.raises((AttributeError, RuntimeError), match=error):
        transformers.DbrxForCausalLM(config)(input_ids=make_batches()[0][0])


CAPPED = (r"it computes 30 \* tanh\(that / 30\): a final-logit softcap, .*final_logit_softcapping .*set it to None "
          r"or turn ")
SCALED = r"it computes 0.25 times that: a logit scale, .*logits_scaling or logit_scale.*set it to 1 or turn "


@pytest.mark.parametrize("name, kwargs, match, plain", [
    ("Gemma2Config", dict(tie_word_embeddings=True), CAPPED, dict(final_logit_softcapping=None)),  # 30: the default
    ("Gemma2Config", dict(tie_word_embeddings=False), CAPPED, dict(final_logit_softcapping=None)),
    ("VaultGemmaConfig", dict(head_dim=16, final_logit_softcapping=30.0), CAPPED, dict(final_logit_softcapping=None)),
    ("NanoChatConfig", dict(final_logit_softcapping=30.0), CAPPED, dict(final_logit_softcapping=None)),
    ("HyperCLOVAXConfig", dict(head_dim=16, logits_scaling=0.25), SCALED, dict(logits_scaling=1.0)),
    ("GraniteSWAConfig", dict(logits_scaling=4.0), SCALED, dict(logits_scaling=1.0)),
    ("MiniCPM3Config", dict(dim_model_base=16), SCALED, dict(dim_model_base=64)),   # logits_scaling: hidden / 16
    ("Cohere2MoeConfig", dict(head_dim=16, logit_scale=0.25), SCALED, dict(logit_scale=1.0)),
], ids=["gemma2-tied", "gemma2", "vaultgemma", "nanochat", "hyperclovax", "granite_swa", "minicpm3", "cohere2_moe"])
def test_vocab_parallelism_refuses_a_scaled_or_capped_head(name: str, kwargs: dict, match: str, plain: dict) -> None:
    """The split head computes x @ W.T alone: a head that scales its logits (logits_scaling, logit_scale) or caps
    them (final_logit_softcapping), tied or not, is refused naming the scale or the cap, while the same head
    without it is taken."""
    from ds_terapipe.runtime.features.vocab_shard import build_full, split_output_layer
    config = getattr(transformers, name)(**COMMON, **TOKENS, **kwargs)
    _, head = split_output_layer(causal_lm_specs(config))
    with pytest.raises(ValueError, match=match + "terapipe.vocab_parallel"):
        build_full(head)
    for key, value in plain.items():
        setattr(config, key, value)
    build_full(split_output_layer(causal_lm_specs(config))[1])


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_vocab_parallelism_takes_the_heads_of_sinks_and_latent_attention_models(arch: str) -> None:
    """gpt-oss' and DeepSeek's heads are plain x @ W.T: the vocabulary-parallel split takes them."""
    from ds_terapipe.runtime.features.vocab_shard import build_full, split_output_layer
    build_full(split_output_layer(causal_lm_specs(tiny_config(arch)))[1])


def test_the_readme_counts_the_supported_model_types() -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"Hugging Face causal LMs of {len(SUPPORTED_MODEL_TYPES)} model types" in readme


def test_masks_and_headless_models_are_refused() -> None:
    stages, _ = build_stages(causal_lm_specs(tiny_config("llama")), num_stages=1)
    ids = make_batches()[0][0]
    with pytest.raises(UnsupportedModelError, match="padding"):
        stages[0][0]((ids, torch.ones_like(ids)))
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(UnsupportedModelError, match="padding masks are not supported"):
        terapipe_attention(torch.nn.Module(), q, q, q, torch.zeros(1, 1, 3, 3))
    with pytest.raises(UnsupportedModelError, match="LM head"):
        causal_lm_specs(transformers.LlamaModel(tiny_config("llama")))


def test_each_family_slides_the_layers_its_model_masks_slide() -> None:
    """The ``_FAMILIES`` table says which layers get ``config.sliding_window``: none, every layer (the *Model builds
    one sliding mask when it is set), or the 'sliding_attention' entries of ``layer_types`` (one mask per type);
    which get ``config.attention_chunk_size`` (the 'chunked_attention' entries: Llama 4); and whose attention reads
    its position offset from the cache (Llama 4's temperature tuning): transformers' modeling code must say the
    same."""
    import inspect

    from ds_terapipe.models.hf import _FAMILIES, _modeling

    for model_type, family in _FAMILIES.items():
        source = inspect.getsource(_modeling(family))
        assert ("create_sliding_window_causal_mask" in source) == (family.window is not None), model_type
        by_type = re.search(r"config\.layer_types\[(i|layer_idx)\]", source) is not None   # a mask per layer type
        assert by_type == (family.window == "layer_types" or family.chunked), model_type
        assert ("create_chunked_causal_mask" in source) == family.chunked, model_type
        assert ("get_seq_length(self.layer_idx)" in source) == family.offset_cache, model_type


@pytest.mark.parametrize("packed", [False, True])
def test_the_chunk_rule_is_transformers_own(packed: bool) -> None:
    """The chunked attention the sliced attention runs (``chunked_documents``: chunks as documents) equals the mask
    ``transformers``' Llama 4 builds for its chunked layers, key by key: chunks of 5 from the row's start, and for
    packed rows (position ids restarting) from each document's start, within it."""
    from transformers.masking_utils import create_chunked_causal_mask

    from ds_terapipe.runtime.slicing.documents import Documents, chunked_documents

    config = transformers.Llama4TextConfig(**COMMON, attention_chunk_size=5)
    config._attn_implementation = "sdpa"
    positions = torch.tensor([list(range(7)) + list(range(13)), list(range(12)) + list(range(8))]) if packed \
        else torch.arange(20).expand(2, -1)
    theirs = create_chunked_causal_mask(config, torch.zeros(2, 20, 8), None, None, position_ids=positions,
                                        allow_is_causal_skip=False)                     # (B, 1, L, L) booleans
    docs = chunked_documents(Documents(positions) if packed else None, 5, 2, 20, torch.device("cpu"))
    ours = docs.mask(0, 20, torch.float32) == 0
    assert torch.equal(ours.expand_as(theirs), theirs), (ours.int(), theirs.int())


def test_the_window_bound_is_transformers_own() -> None:
    """``causal_visible`` (the band every windowed path masks with) equals transformers' sliding-window causal mask
    function, key by key: at most ``window`` keys, the query's own included."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    from ds_terapipe.runtime.slicing.documents import causal_visible

    for window in (1, 2, 5, 16):
        theirs = sliding_window_causal_mask_function(window)
        for start, end, first in ((0, 16, 0), (5, 12, 0), (9, 16, 6)):
            want = theirs(0, 0, torch.arange(start, end)[:, None], torch.arange(first, end)[None, :])
            assert torch.equal(causal_visible(start, end, first, window, torch.device("cpu")), want), window


def test_an_attention_call_whose_window_disagrees_with_the_mask_is_refused() -> None:
    """Inside a pipeline decoder layer the window is the model's mask's; a layer that passes another
    ``sliding_window`` is refused (rule, values, fix). Called outside the layers, the call's own argument is the
    window."""
    import torch.nn.functional as F

    from ds_terapipe.models.hf import _layer_window

    torch.manual_seed(0)
    q = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    with _layer_window(5), pytest.raises(UnsupportedModelError,
                                         match="passes sliding_window=7 but the model's mask gives this layer "
                                               "window=5.*set config.sliding_window and config.layer_types"):
        terapipe_attention(torch.nn.Module(), q, q, q, None, sliding_window=7)
    visible = torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6, dtype=torch.bool).tril(-2)
    want = F.scaled_dot_product_attention(q, q, q, attn_mask=visible).transpose(1, 2)
    torch.testing.assert_close(terapipe_attention(torch.nn.Module(), q, q, q, None, sliding_window=2)[0], want)


def test_a_whole_llama4_routed_to_the_sliced_attention_attends_in_chunks() -> None:
    """Llama 4 run whole (not as pipeline layers) with its attention routed to ds_terapipe: outside the pipeline's
    decoder layers each chunked layer takes its chunk from its own config and layer index, so the logits equal the
    eager model's (whose mask cuts the chunks)."""
    model = hf_model("llama4_text")
    config = copy.deepcopy(model.config)
    config._attn_implementation = "ds_terapipe"
    routed = transformers.Llama4ForCausalLM(config).eval()
    routed.load_state_dict(model.state_dict())
    ids = make_batches()[0][0]
    with torch.no_grad():
        assert rel_err(routed(input_ids=ids).logits, model(input_ids=ids).logits) <= TOL


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_two_stage_engine_equals_transformers(tmp_path) -> None:
    """ds_terapipe.initialize on 2 gloo processes, a Llama GQA model from a config, slices [3, 9, 4], 1f1b
    and gpipe (deferred weight gradients), and with vocabulary parallelism (untied and tied heads): loss and every
    gradient equal transformers' on the same weights (a shard's against its rows)."""
    from tests.dist_harness import run_ranks, suite_command

    codes, texts = run_ranks(suite_command("hf", tmp_path), 2, tmp_path, timeout_s=240)
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        for case in result["cases"]:
            assert abs(case["loss"] - case["ref_loss"]) <= TOL * abs(case["ref_loss"]), case
            assert case["grad_rel_err"] <= TOL, case
    for index, case in enumerate(results[0]["cases"]):  # every parameter compared, on one rank or the other
        covered = set().union(*(r["cases"][index]["covered"] for r in results))
        assert covered == set(case["all_params"]), (case["schedule"], set(case["all_params"]) ^ covered)
    # vocabulary parallelism on the Hugging Face head (untied lm_head, then tied to the input embedding): the
    # shards hold the head (and the input embedding's table) on both ranks
    assert [(c["vocab_parallel"], c["tied"]) for c in results[0]["cases"]] == \
        [(False, False), (False, False), (True, False), (True, True)]
    for index in (2, 3):
        assert all(any(n in ("lm_head.weight", "model.embed_tokens.weight") for n in r["cases"][index]["covered"])
                   for r in results), index
    # the untied lm_head's input embedding is split too: both ranks hold rows of its table
    assert all("model.embed_tokens.weight" in r["cases"][2]["covered"] for r in results)
