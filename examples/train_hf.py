"""Train a Hugging Face causal LM (Llama architecture by default) with token-level pipeline parallelism on CPU.

    deepspeed --num_gpus 2 examples/train_hf.py --deepspeed_config ds_configs/cpu_2stage.json --steps 20

The model is ``transformers``' own (``pip install -e '.[hf]'``): built from a config (``--arch llama|mistral|
qwen2|qwen3|gpt2``, sizes from ``--layers --hidden --heads --kv-heads``, random init) or loaded with its weights
from a local directory written by ``save_pretrained`` (``--model-dir``; nothing is downloaded), and cut into
pipeline layers by :func:`ds_terapipe.models.hf.causal_lm_specs`. Data, evaluation, checkpoints, metrics and
threads work as in ``examples/train_gpt.py`` (same options): byte-level text, by default the Python standard
library's own source.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers

import deepspeed
import ds_terapipe
from ds_terapipe.models.hf import causal_lm_loss, causal_lm_specs
from ds_terapipe.runtime.shm import remove_shm_segments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import Batches, load_tokens  # noqa: E402  (the same corpus and batches as the GPT example)

CONFIGS = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps to train")
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages (default: config pipeline.stages or 2)")
    parser.add_argument("--arch", choices=[*CONFIGS, "gpt2"], default="llama", help="architecture built from a config")
    parser.add_argument("--model-dir", default=None, help="a local save_pretrained directory (weights kept)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--data", nargs="*", default=None, help="text files, or one .bin of uint16 token ids")
    parser.add_argument("--vocab-size", type=int, default=256, help="for .bin token files (bytes: 256)")
    parser.add_argument("--max-corpus-mb", type=float, default=8.0, help="cap on the default corpus size")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--save-dir", default=None, help="checkpoint directory")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--metrics", default=None, help="append one JSON line per step (step, loss) to this file")
    parser.add_argument("--bind-cores", action="store_true",
                        help="CPU: pin each local process to its own share of the cores (as train_gpt.py)")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.deepspeed_config is None:
        parser.error("--deepspeed_config is required (e.g. ds_configs/cpu_2stage.json)")
    if args.resume and not args.save_dir:
        parser.error("--resume needs --save-dir (where the checkpoints are)")
    return args


def model_config(args: argparse.Namespace, vocab: int, seq_len: int) -> transformers.PretrainedConfig:
    """The model's config: read from ``--model-dir``, else built from the size options."""
    if args.model_dir:
        return transformers.AutoConfig.from_pretrained(args.model_dir, local_files_only=True)
    if args.arch == "gpt2":
        return transformers.GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, vocab_size=vocab,
                                       n_positions=seq_len, bos_token_id=0, eos_token_id=0)
    extra = {"sliding_window": None} if args.arch == "mistral" else {}
    return CONFIGS[args.arch](hidden_size=args.hidden, intermediate_size=int(8 * args.hidden / 3) // 8 * 8,
                              num_hidden_layers=args.layers, num_attention_heads=args.heads,
                              num_key_value_heads=args.kv_heads, vocab_size=vocab, max_position_embeddings=seq_len,
                              bos_token_id=0, eos_token_id=0, **extra)


def main() -> None:
    args = parse_args()
    ds_terapipe.configure_logging()
    if not torch.cuda.is_available():
        # One process per stage shares the cores: more threads than cores per process makes ranks spin.
        local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
        threads = max(1, (os.cpu_count() or 1) // local)
        if args.bind_cores:
            cores = sorted(os.sched_getaffinity(0))
            share = max(1, len(cores) // local)
            mine = cores[(args.local_rank * share) % len(cores):][:share]
            os.sched_setaffinity(0, mine)
            threads = len(mine)
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(threads)
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else None)
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    terapipe = ds_terapipe.parse_terapipe_config(ds_config)
    stages = args.stages or ds_config.get("pipeline", {}).get("stages") or 2
    if not isinstance(stages, int) or stages < 1:
        raise SystemExit(f"train_hf: --stages / pipeline.stages must be a positive int, got {stages!r}")
    seq_len = terapipe.seq_len or 256
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()

    tokens = load_tokens(args)
    vocab = args.vocab_size if args.data and args.data[0].endswith(".bin") else 256
    config = model_config(args, vocab, seq_len)
    if int(tokens.max()) >= config.vocab_size:
        raise SystemExit(f"train_hf: token id {int(tokens.max())} >= the model's vocab_size {config.vocab_size}")
    split = int(len(tokens) * 0.9)
    specs = causal_lm_specs(args.model_dir or config, seed=args.seed)
    model = ds_terapipe.TokenPipelineModule(specs, num_stages=stages, loss_fn=causal_lm_loss,
                                            vocab_size=config.vocab_size, partition_method="uniform")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    engine, _, _, _ = ds_terapipe.initialize(args=args, model=model, optimizer=optimizer)

    micro, gas = engine.micro_batch_size, engine.micro_batches
    dp_rank = engine.grid.data_parallel_id
    train = Batches(tokens[:split], seq_len, micro, args.seed, dp_rank)
    held_out = Batches(tokens[split:], seq_len, micro, args.seed + 1, dp_rank)
    plan = engine.plan_summary() if hasattr(engine, "plan_summary") else {"slices": [seq_len]}
    if rank == 0:
        kv_heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
        print(f"model {config.model_type} ({args.model_dir or 'from config'}): {config.num_hidden_layers} layers, "
              f"hidden {config.hidden_size}, {config.num_attention_heads} heads / {kv_heads} kv heads, "
              f"vocab {config.vocab_size}; "
              f"world {world} = {stages} stage(s) x {world // stages} replica(s), micro-batch {micro} x {gas}, "
              f"seq_len {seq_len}", flush=True)
        print(f"plan: {json.dumps(plan)}", flush=True)

    start_step = 0
    if args.resume:
        path, client = engine.load_checkpoint(args.save_dir)
        if path is None:
            raise SystemExit(f"train_hf: --resume but no checkpoint found in {args.save_dir}")
        start_step = int(client.get("step", 0))
        if rank == 0:
            print(f"resumed from {path} at step {start_step}", flush=True)

    tokens_per_step = micro * gas * (world // stages) * seq_len
    window_start, window_steps = time.perf_counter(), 0
    for step in range(start_step, args.steps):
        loss = engine.train_batch(train.iterator(step, gas))
        window_steps += 1
        done = step + 1
        if args.metrics and rank == 0:
            with open(args.metrics, "a") as f:
                f.write(json.dumps({"step": done, "loss": float(loss)}) + "\n")
        if rank == 0 and (done % args.log_every == 0 or done == args.steps):
            elapsed = time.perf_counter() - window_start
            print(f"step {done:5d}  loss {float(loss):.4f}  {tokens_per_step * window_steps / elapsed:,.0f} tokens/s  "
                  f"{elapsed / window_steps * 1e3:.0f} ms/step", flush=True)
            window_start, window_steps = time.perf_counter(), 0
        if args.eval_every and (done % args.eval_every == 0 or done == args.steps):
            val = engine.eval_batch(held_out.iterator(10**6 + step, gas))
            if rank == 0:
                print(f"step {done:5d}  held-out loss {float(val):.4f}", flush=True)
        if args.save_dir and (done % args.save_every == 0 or done == args.steps):
            engine.save_checkpoint(args.save_dir, client_state={"step": done, "terapipe": plan})
    if rank == 0:
        print("done", flush=True)
    # Leave together and tear the process group down explicitly (as train_gpt.py): exiting with gloo's threads
    # still alive can abort the interpreter at shutdown.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    remove_shm_segments(os.environ.get("MASTER_PORT", "29500"), args.local_rank)  # DeepSpeed leaves them behind


if __name__ == "__main__":
    sys.exit(main())
