"""Train a Hugging Face causal LM (Llama architecture by default) with token-level pipeline parallelism on CPU.

    deepspeed --num_gpus 2 examples/train_hf.py --deepspeed_config ds_configs/cpu_2stage.json --steps 20

The model is ``transformers``' own (``pip install -e '.[hf]'``): built from a config (``--arch``: any
``config.model_type`` of ``ds_terapipe.models.hf.SUPPORTED_MODEL_TYPES``, e.g. llama, gemma2, phi3, olmo2,
granite, qwen3_moe, mixtral; sizes from ``--layers --hidden --heads --kv-heads``, sliding windows as the
architecture's defaults set them, random init) or loaded with its weights from a local directory written by
``save_pretrained`` (``--model-dir``; nothing is downloaded), and cut into pipeline layers by
:func:`ds_terapipe.models.hf.causal_lm_specs`. Data, evaluation, checkpoints, metrics and threads work as in
``examples/train_gpt.py`` (same options): byte-level text, by default the Python standard library's own source.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

import ds_terapipe
from ds_terapipe.models.hf import SUPPORTED_MODEL_TYPES, causal_lm_loss, causal_lm_specs

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The GPT example's corpus, shared options, set-up and training loop.
from train_gpt import load_documents, parse_training_args, start, train, training_parser  # noqa: E402


def arch_settings(arch: str, args: argparse.Namespace, intermediate: int, seq_len: int) -> dict[str, Any]:
    """What ``arch`` needs beyond the size options so that the token pipeline runs it exactly and the small shapes
    hold: a few small experts (the defaults have up to 256 experts, each as wide as a dense MLP), and latent attention
    (DeepSeek, Youtu, MiniCPM3, ...) sized to the heads (its keys and values have every head: num_key_value_heads is
    the head count), and DBRX's nested attention and expert configs. Sliding windows, softcapping (Gemma 2) and
    attention sinks (gpt-oss) stay as the architecture sets them; Llama 4's attention chunks (8192 tokens by default,
    longer than the example's rows) are a quarter of the sequence, so its chunked layers attend in chunks."""
    experts = {"num_experts_per_tok": 2}
    small = {"moe_intermediate_size": intermediate // 2}
    head_dim = args.hidden // args.heads
    gemma = {"query_pre_attn_scalar": head_dim}
    mla = {"num_key_value_heads": args.heads, "q_lora_rank": args.hidden // 2, "kv_lora_rank": args.hidden // 4,
           "qk_nope_head_dim": head_dim, "qk_rope_head_dim": head_dim // 2, "v_head_dim": head_dim}
    latent = {**experts, **small, **mla, "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
              "first_k_dense_replace": 1}
    return {
        "gemma2": gemma,
        "gemma3_text": gemma,
        "vaultgemma": gemma,
        "mixtral": {**experts, "num_local_experts": 4},
        "qwen3_moe": {**experts, "num_experts": 4, **small},
        "qwen2_moe": {**experts, "num_experts": 4, **small, "shared_expert_intermediate_size": intermediate},
        "granitemoe": {**experts, "num_local_experts": 4},
        "granitemoeshared": {**experts, "num_local_experts": 4, "shared_intermediate_size": intermediate},
        "gpt_oss": {**experts, "num_local_experts": 4},
        "deepseek_v3": latent,
        "deepseek_v2": {**latent, "topk_method": "group_limited_greedy"},
        "sarvam_mla": latent,
        "youtu": mla,
        "minicpm3": mla,
        "glm4_moe_lite": {**mla, **experts, "n_routed_experts": 4, **small},
        "mimo_v2_flash": {**experts, "n_routed_experts": 4, **small, "v_head_dim": head_dim},
        "granitemoe_swa": {**experts, "num_local_experts": 4},
        "cohere2_moe": {**experts, "num_experts": 4},
        "laguna": {**experts, "num_experts": 4, **small, "shared_expert_intermediate_size": intermediate},
        # a rotary table per layer type (its default config names none; multimodal sections, one text position)
        "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                                       "mrope_section": [head_dim // 4, head_dim // 8,
                                                                                         head_dim // 8]}}},
        "olmoe": {**experts, "num_experts": 4},
        "flex_olmo": {**experts, "num_experts": 4},
        "phimoe": {**experts, "num_local_experts": 4},
        "minimax_m2": {**experts, "num_local_experts": 4},
        "jetmoe": {**experts, "num_local_experts": 4},
        "hunyuan_v1_moe": {"num_experts": 4, "moe_topk": 2},
        "aria_text": {"moe_num_experts": 4, "moe_topk": 2},
        "ernie4_5_moe": {"moe_num_experts": 4, "moe_k": 2, **small},
        "glm4_moe": {**experts, "n_routed_experts": 4, **small},
        "solar_open": {**experts, "n_routed_experts": 4, **small},
        "dots1": {**experts, "n_routed_experts": 4, "n_shared_experts": 1, **small},
        "exaone_moe": {**experts, "num_experts": 4, **small},
        "afmoe": {**experts, "num_experts": 4, **small},
        "hy_v3": {**experts, "num_experts": 4, **small},
        "mellum": {**experts, "num_local_experts": 4, **small},
        "kolibri1": {**experts, "num_local_experts": 4, **small, "shared_expert_intermediate_size": intermediate},
        "llama4_text": {**experts, "num_local_experts": 4, "intermediate_size_mlp": intermediate,
                        "attention_chunk_size": max(1, seq_len // 4)},
        # nested configs: the experts' width follows d_model (not hidden_size); transformers' attention needs
        # attn_config's rope_theta (the rotary module takes rope_parameters') and clip_qkv (DBRX's: 8)
        "dbrx": {"d_model": args.hidden, "attn_config": {"kv_n_heads": args.kv_heads, "rope_theta": 1e4,
                                                         "clip_qkv": 8.0},
                 "ffn_config": {"ffn_hidden_size": intermediate // 2, "moe_num_experts": 4, "moe_top_k": 2}},
    }.get(arch, {})


def parse_args() -> argparse.Namespace:
    parser = training_parser(__doc__)
    parser.add_argument("--arch", choices=SUPPORTED_MODEL_TYPES, default="llama", metavar="MODEL_TYPE",
                        help=f"architecture built from a config: {', '.join(SUPPORTED_MODEL_TYPES)}")
    parser.add_argument("--model-dir", default=None, help="a local save_pretrained directory (weights kept)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    return parse_training_args(parser)


def model_config(args: argparse.Namespace, vocab: int, seq_len: int) -> transformers.PretrainedConfig:
    """The model's config: read from ``--model-dir``, else built from the size options."""
    if args.model_dir:
        return transformers.AutoConfig.from_pretrained(args.model_dir, local_files_only=True)
    if args.arch == "gpt2":
        return transformers.GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, vocab_size=vocab,
                                       n_positions=seq_len, bos_token_id=0, eos_token_id=0)
    config_class = transformers.CONFIG_MAPPING[args.arch]
    intermediate = int(8 * args.hidden / 3) // 8 * 8
    extra = arch_settings(args.arch, args, intermediate, seq_len)
    if "head_dim" in getattr(config_class, "__dataclass_fields__", {}):  # a fixed default (Gemma: 256) otherwise
        extra.setdefault("head_dim", args.hidden // args.heads)
    # pad_token_id None: byte-level text has no padding, and a padding row's embedding would never train
    sizes = dict(hidden_size=args.hidden, intermediate_size=intermediate, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=vocab,
                 max_position_embeddings=seq_len, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return config_class(**{**sizes, **extra})   # extra wins: DeepSeek's key/value heads are its heads


def main() -> None:
    args = parse_args()
    # --pack (terapipe.packed) is in the config (handed over as a dict) before it is validated
    _, config_dict, terapipe, stages, seq_len = start(args, "train_hf")
    tokens, starts = load_documents(args)
    vocab = args.vocab_size if args.data and args.data[0].endswith(".bin") else 256
    config = model_config(args, vocab, seq_len)
    if int(tokens.max()) >= config.vocab_size:
        raise SystemExit(f"train_hf: token id {int(tokens.max())} >= the model's vocab_size {config.vocab_size}")
    specs = causal_lm_specs(args.model_dir or config, seed=args.seed)
    model = ds_terapipe.TokenPipelineModule(specs, num_stages=stages, loss_fn=causal_lm_loss,
                                            vocab_size=config.vocab_size, partition_method="uniform",
                                            activation_checkpoint_interval=args.checkpoint_interval,
                                            **ds_terapipe.module_chunk_kwargs(terapipe))  # virtual stages
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    engine, _, _, _ = ds_terapipe.initialize(args=args, model=model, optimizer=optimizer, config=config_dict)
    kv_heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
    train(engine, args, tokens, seq_len, stages, name="train_hf", starts=starts,
          header=f"model {config.model_type} ({args.model_dir or 'from config'}): {config.num_hidden_layers} layers, "
                 f"hidden {config.hidden_size}, {config.num_attention_heads} heads / {kv_heads} kv heads, "
                 f"vocab {config.vocab_size}")


if __name__ == "__main__":
    sys.exit(main())
