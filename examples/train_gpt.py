"""Train the reference GPT with token-level pipeline parallelism on CPU (or GPU, unchanged).

    deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config ds_configs/cpu_2stage.json --steps 150

Data: byte-level (vocab 256) text. By default the corpus is the Python standard library's own source code,
present on any machine with Python; ``--data FILE ...`` takes text files instead, or one ``.bin`` file of
uint16 token ids (nanoGPT's layout; pass ``--vocab-size``). Every ``--eval-every`` steps a held-out loss is
computed on the last 10% of the corpus; with ``--save-dir`` a DeepSpeed checkpoint is written every
``--save-every`` steps, and ``--resume`` continues from the latest one.

On a CPU-only machine the ``deepspeed`` launcher still works: ``--num_gpus N`` starts N processes (gloo).
The number of pipeline stages comes from ``--stages`` (default: the config's ``pipeline.stages``, else 2);
the remaining factor of the world size is data parallelism.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

import deepspeed
import ds_terapipe
from ds_terapipe.models.gpt import GPTConfig, causal_lm_loss, gpt_layer_specs
from ds_terapipe.runtime.execution.shm import remove_shm_segments


def setup_logging() -> None:
    """Show ds_terapipe's log lines (the plan, profiling, faults) the way DeepSpeed shows its own.

    A library only adds a NullHandler; the application decides what is shown. Here: ds_terapipe at INFO, or at
    ``DS_TERAPIPE_LOG_LEVEL`` (e.g. DEBUG), on stderr as ``[time] [LEVEL] [name] message``; other loggers at INFO.
    """
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] [%(name)s] %(message)s")
    ds_terapipe.configure_logging()


def training_parser(doc: str) -> argparse.ArgumentParser:
    """The options every example trainer shares (data, schedule of the run, checkpoints, threads); a trainer adds
    its model's options and calls :func:`parse_training_args`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps to train")
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages (default: config pipeline.stages or 2)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--data", nargs="*", default=None, help="text files, or one .bin of uint16 token ids")
    parser.add_argument("--vocab-size", type=int, default=256, help="for .bin token files (bytes: 256)")
    parser.add_argument("--max-corpus-mb", type=float, default=8.0, help="cap on the default corpus size")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--save-dir", default=None, help="checkpoint directory")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    parser.add_argument("--resume-weights-only", action="store_true",
                        help="--resume with the checkpoint's weights, step count and lr scheduler and a fresh "
                             "optimizer: after changing zero_optimization.stage, bf16/fp16 or terapipe.shard_params, "
                             "which keep the optimizer state another way")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--metrics", default=None, help="append one JSON line per step (step, loss) to this file")
    parser.add_argument("--bind-cores", action="store_true",
                        help="CPU: pin each local process to its own share of the cores (what the deepspeed launcher's "
                             "--bind_cores_to_rank does with numactl); stages then stop preempting each other")
    parser.add_argument("--checkpoint-interval", type=int, default=0,
                        help="activation checkpointing every N layers (0: off); each slice's forward is recomputed "
                             "in its backward with the earlier slices' cached keys/values")
    parser.add_argument("--pack", action="store_true",
                        help="packed documents (terapipe.packed): rows of whole files, position ids restarting at "
                             "each file, attention within each file, no loss across a file boundary")
    parser.add_argument("--compile", default=None, metavar="BACKEND",
                        help="engine.compile(backend=BACKEND) before training (torch.compile per chunk; e.g. inductor, "
                             "aot_eager); the sliced attention stays outside the graphs")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return parser


def parse_training_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.deepspeed_config is None:
        parser.error("--deepspeed_config is required (e.g. ds_configs/cpu_2stage.json)")
    args.resume = args.resume or args.resume_weights_only
    if args.resume and not args.save_dir:
        parser.error("--resume needs --save-dir (where the checkpoints are)")
    return args


def parse_args() -> argparse.Namespace:
    parser = training_parser(__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--freeze", default=None,
                        help="progressive freezing (terapipe.freeze): 'STEP:LAYERS,...' (e.g. 20:2,40:4: from step 20 "
                             "the first 2 layers are frozen, from step 40 the first 4) or 'auto' (gradient-norm "
                             "policy, checked every 10 steps); overrides the config's terapipe.freeze")
    parser.add_argument("--partition", default=None,
                        help="how layers are cut into stages: a DeepSpeed partition_method ('uniform', 'parameters', "
                             "'type:GPTBlock'), 'terapipe' (cost-based: layers profiled, boundaries and slicing "
                             "planned together) or 'parts:0,5,11'. Default: 'type:GPTBlock' (equal blocks per "
                             "stage) when there are at least as many blocks as chunks, else 'uniform'")
    parser.add_argument("--repack", action="store_true",
                        help="with freezing: once a pipeline stage holds frozen layers only, continue on fewer stages "
                             "with more data-parallel replicas (terapipe.freeze.repack)")
    return parse_training_args(parser)


def freeze_section(spec: str) -> dict:
    """``--freeze`` as the config's ``terapipe.freeze`` section."""
    if spec == "auto":
        return {"auto": {"check_interval": 10}}
    try:
        return {"schedule": [[int(step), int(layers)] for step, layers in
                             (item.split(":") for item in spec.split(","))]}
    except ValueError:
        raise SystemExit(f"train_gpt: --freeze {spec!r}: use STEP:LAYERS[,STEP:LAYERS...] or auto") from None


def load_tokens(args: argparse.Namespace) -> np.ndarray:
    """The corpus as a 1-D array of token ids."""
    return load_documents(args)[0]


def load_documents(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """The corpus as a 1-D array of token ids, and where each document (file) starts in it."""
    if args.data:
        paths = [Path(p) for p in args.data]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise SystemExit(f"train_gpt: --data file(s) not found: {missing}")
        if len(paths) == 1 and paths[0].suffix == ".bin":
            return np.fromfile(paths[0], dtype=np.uint16).astype(np.int64), np.zeros(1, dtype=np.int64)
        chunks = [p.read_bytes() for p in paths]
    else:
        # Default corpus: the standard library's source, sorted, so every rank and every run reads the same bytes.
        root = Path(sysconfig.get_paths()["stdlib"])
        budget, chunks = int(args.max_corpus_mb * 2**20), []
        for path in sorted(root.glob("*.py")):
            data = path.read_bytes()
            chunks.append(data)
            budget -= len(data)
            if budget <= 0:
                break
    starts = np.cumsum([0] + [len(c) for c in chunks[:-1]], dtype=np.int64)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.int64), starts


class Batches:
    """Random windows of ``seq_len + 1`` tokens: (inputs, next-token labels) micro-batches.

    Seeded by (seed, split, data-parallel rank, step), so a resumed run sees the data it would have seen.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch: int, seed: int, dp_rank: int) -> None:
        if len(tokens) <= seq_len + 1:
            raise SystemExit(f"train_gpt: corpus of {len(tokens)} tokens is shorter than seq_len {seq_len}")
        self.tokens, self.seq_len, self.batch, self.seed, self.dp_rank = tokens, seq_len, batch, seed, dp_rank

    def iterator(self, step: int, count: int):
        rng = np.random.default_rng([self.seed, self.dp_rank, step])
        for _ in range(count):
            starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, self.batch)
            window = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])
            ids = torch.from_numpy(window)
            yield ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class PackedBatches(Batches):
    """Random windows of the corpus as packed rows: ``((ids, position_ids), labels)``, the position ids restarting
    at 0 where a document (file) starts inside the window, and no label across a document boundary (-100: the
    loss counts every token's prediction within its own document once)."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, seq_len: int, batch: int, seed: int,
                 dp_rank: int) -> None:
        super().__init__(tokens, seq_len, batch, seed, dp_rank)
        self.starts = starts

    def iterator(self, step: int, count: int):
        rng = np.random.default_rng([self.seed, self.dp_rank, step])
        for _ in range(count):
            begins = rng.integers(0, len(self.tokens) - self.seq_len - 1, self.batch)
            yield ds_terapipe.packed_rows(self.tokens, self.starts, begins, self.seq_len)


def apply_overrides(ds_config: dict, args: argparse.Namespace, name: str) -> bool:
    """The command line's settings, written into ``ds_config`` (in place) before it is validated: ``--pack``
    (terapipe.packed) and, where the trainer has them, ``--freeze`` (terapipe.freeze) and ``--repack``
    (terapipe.freeze.repack); ``--stages`` over a ``pipeline.stages`` of another count (the engine refuses a
    section that disagrees with the module it shapes). True when one was written. ``--checkpoint-interval`` shapes
    the module only."""
    pipeline, stages = ds_config.get("pipeline"), getattr(args, "stages", None)
    restaged = isinstance(pipeline, dict) and stages is not None and pipeline.get("stages", stages) != stages
    if restaged:
        pipeline["stages"] = stages
    pack, freeze, repack = getattr(args, "pack", False), getattr(args, "freeze", None), getattr(args, "repack", False)
    if not (pack or freeze or repack):
        return restaged
    section = ds_config.get("terapipe")
    if section is None:
        section = ds_config["terapipe"] = {}
    if not isinstance(section, dict):
        return False   # not an object: validation refuses the config with its rule
    if pack:
        section["packed"] = True
    if freeze:
        section["freeze"] = freeze_section(freeze)
    if repack:
        if not isinstance(section.get("freeze"), dict):
            raise SystemExit(f"{name}: --repack needs --freeze or a terapipe.freeze section in the config")
        section["freeze"]["repack"] = True
    return True


def read_config(args: argparse.Namespace, name: str) -> tuple[dict, Optional[dict], Any]:
    """The DeepSpeed config of ``--deepspeed_config`` with the command line's overrides applied, then validated:
    ``(ds_config, config, terapipe config)``. ``config`` is what ``initialize`` gets: the changed dict (and
    ``args.deepspeed_config`` then None), or None when the file is used as it is."""
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    changed = apply_overrides(ds_config, args, name)
    terapipe = ds_terapipe.parse_terapipe_config(ds_config)   # after the overrides: --pack makes packed true
    if not changed:
        return ds_config, None, terapipe
    args.deepspeed_config = None
    return ds_config, ds_config, terapipe


def start(args: argparse.Namespace, name: str) -> tuple[dict, Optional[dict], Any, int, int]:
    """Threads, the process group and the config: ``(ds_config, config for initialize, terapipe config, stages,
    seq_len)`` (see :func:`read_config`)."""
    setup_logging()
    if not torch.cuda.is_available():
        # One process per stage shares the cores: more threads than cores per process makes every rank spin
        # against the others (10x slower on a 2-core machine).
        local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
        threads = max(1, (os.cpu_count() or 1) // local)
        if args.bind_cores:
            cores = sorted(os.sched_getaffinity(0))
            share = max(1, len(cores) // local)
            mine = cores[(args.local_rank * share) % len(cores):][:share]
            os.sched_setaffinity(0, mine)
            threads = len(mine)
        if "OMP_NUM_THREADS" not in os.environ:  # an explicit thread count stays the user's
            torch.set_num_threads(threads)
    ds_terapipe.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else None)
    ds_config, config, terapipe = read_config(args, name)
    stages = args.stages or ds_config.get("pipeline", {}).get("stages") or 2
    if not isinstance(stages, int) or stages < 1:
        raise SystemExit(f"{name}: --stages / pipeline.stages must be a positive int, got {stages!r}")
    return ds_config, config, terapipe, stages, terapipe.seq_len or 256


def train(engine: Any, args: argparse.Namespace, tokens: np.ndarray, seq_len: int, stages: int, header: str,
          name: str, starts: Optional[np.ndarray] = None) -> None:
    """The training loop: 90/10 train/held-out split, resume, logging, evaluation, checkpoints; then leave."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    split = int(len(tokens) * 0.9)
    micro, gas = engine.micro_batch_size, engine.micro_batches
    dp_rank = engine.grid.data_parallel_id
    if args.pack:   # documents: the files; the held-out split starts a document of its own
        if not getattr(getattr(engine, "terapipe", None), "packed", False):
            raise SystemExit(f"{name}: --pack needs the token pipeline (terapipe.enabled) with terapipe.packed")
        docs = np.zeros(1, dtype=np.int64) if starts is None else starts
        train_data: Batches = PackedBatches(tokens[:split], docs[docs < split], seq_len, micro, args.seed, dp_rank)
        held_out: Batches = PackedBatches(tokens[split:], np.concatenate([[0], docs[docs > split] - split]), seq_len,
                                          micro, args.seed + 1, dp_rank)
    else:
        train_data = Batches(tokens[:split], seq_len, micro, args.seed, dp_rank)
        held_out = Batches(tokens[split:], seq_len, micro, args.seed + 1, dp_rank)
    if args.compile:
        engine.compile(backend=args.compile)
        if rank == 0:
            print(f"engine.compile(backend={args.compile!r}): compiled={engine.is_compiled}", flush=True)
    plan = engine.plan_summary() if hasattr(engine, "plan_summary") else {"slices": [seq_len]}
    # the world is stages x sequence ranks (terapipe.sequence_parallel) x data-parallel replicas
    sequence = getattr(getattr(engine, "terapipe", None), "sequence_parallel", 1)
    replicas = world // (stages * sequence)
    if rank == 0:
        ranks = f"{stages} stage(s) x " + (f"{sequence} sequence rank(s) x " if sequence > 1 else "")
        print(f"{header}, world {world} = {ranks}{replicas} replica(s), micro-batch {micro} x {gas}, seq_len "
              f"{seq_len}", flush=True)
        print(f"plan: {json.dumps(plan)}", flush=True)

    start_step = 0
    if args.resume:
        path, client = engine.load_checkpoint(args.save_dir, load_optimizer_states=not args.resume_weights_only)
        if path is None:
            raise SystemExit(f"{name}: --resume but no checkpoint found in {args.save_dir}")
        start_step = int(client.get("step", 0))
        if rank == 0:
            print(f"resumed from {path} at step {start_step}", flush=True)

    tokens_per_step = micro * gas * replicas * seq_len
    # With slices "auto" the planner's predicted step (forwards, backwards, W, transfers, and what follows the
    # schedule: tied and data-parallel gradient reduction, optimizer step, end-of-step sync), next to the measured.
    def planned() -> str:  # the plan in use: it changes when layers freeze (re-planned) or the run repacks
        predicted = getattr(engine, "predicted_step_ms", None)
        return f" (plan: {predicted:.0f} ms)" if predicted else ""

    window_start, window_steps = time.perf_counter(), 0
    for step in range(start_step, args.steps):
        loss = engine.train_batch(train_data.iterator(step, gas))
        window_steps += 1
        done = step + 1
        if args.metrics and rank == 0:
            with open(args.metrics, "a") as f:
                f.write(json.dumps({"step": done, "loss": float(loss)}) + "\n")
        if rank == 0 and (done % args.log_every == 0 or done == args.steps):
            elapsed = time.perf_counter() - window_start
            print(f"step {done:5d}  loss {float(loss):.4f}  {tokens_per_step * window_steps / elapsed:,.0f} tokens/s  "
                  f"{elapsed / window_steps * 1e3:.0f} ms/step{planned()}", flush=True)
            window_start, window_steps = time.perf_counter(), 0
        if args.eval_every and (done % args.eval_every == 0 or done == args.steps):
            val = engine.eval_batch(held_out.iterator(10**6 + step, gas))
            if rank == 0:
                print(f"step {done:5d}  held-out loss {float(val):.4f}", flush=True)
        if args.save_dir and (done % args.save_every == 0 or done == args.steps):
            # the engine adds its plan, config and freeze state itself (and runs the plan again on --resume)
            engine.save_checkpoint(args.save_dir, client_state={"step": done})
    if rank == 0:
        print("done", flush=True)
    # Leave together and tear the process group down explicitly: exiting with gloo's threads still alive
    # can abort the interpreter at shutdown.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    remove_shm_segments(os.environ.get("MASTER_PORT", "29500"), args.local_rank)  # DeepSpeed leaves them behind
    # Even so, a C++ thread torn down during interpreter finalisation still aborts a rank now and then
    # ("terminate called without an active exception", exit -6, seen after "done" in the resume test): the
    # work is finished and saved, so leave without running the C++ static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    args = parse_args()
    # --pack, --freeze and --repack are in the config (handed over as a dict) before it is validated
    ds_config, config, terapipe, stages, seq_len = start(args, "train_gpt")
    tokens, starts = load_documents(args)
    vocab = args.vocab_size if args.data and args.data[0].endswith(".bin") else 256
    if int(tokens.max()) >= vocab:
        raise SystemExit(f"train_gpt: token id {int(tokens.max())} >= --vocab-size {vocab}")
    cfg = GPTConfig(num_layers=args.layers, hidden=args.hidden, num_heads=args.heads, vocab_size=vocab,
                    max_seq_len=seq_len, seed=args.seed)
    # DeepSpeed's "uniform" counts the embedding, final norm and head as layers: with 8 blocks on 2 stages it puts
    # 5 blocks on stage 0 and 3 on stage 1, and the pipeline runs at the pace of the heavier stage.
    enabled = terapipe is not None and terapipe.enabled
    chunks = stages * ((terapipe.virtual_stages or 1) if enabled else 1)
    method = args.partition or ("type:GPTBlock" if args.layers >= chunks else "uniform")
    partition = ds_terapipe.partition_kwargs(ds_config) if method == "terapipe" else {"partition_method": method}
    model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=stages, loss_fn=causal_lm_loss,
                                            vocab_size=vocab, activation_checkpoint_interval=args.checkpoint_interval,
                                            **partition, **ds_terapipe.module_chunk_kwargs(terapipe))
    # fused: one kernel over all parameters (CPU and CUDA); on CPU the default per-parameter loop took 169 ms per
    # step for 21M parameters against 51 ms fused, and the step's optimizer tail is on every schedule's critical path
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95), fused=True)
    engine, _, _, _ = ds_terapipe.initialize(args=args, model=model, optimizer=optimizer, config=config)
    train(engine, args, tokens, seq_len, stages, name="train_gpt", starts=starts,
          header=f"corpus {len(tokens):,} tokens ({'--data' if args.data else 'Python stdlib source'})")


if __name__ == "__main__":
    sys.exit(main())
