#!/usr/bin/env bash
# Everything this project checks and measures on one GPU, in the order that pays if the time runs out first:
# the CUDA tests, the slice table with the cost model's prediction beside each point, the engine's host time and
# kernels per slice on the example trainer's shape and its steps compiled, the example trainer in bf16 saving and
# resuming, and compiled.
#
#     bash benchmarks/on_gpu.sh [OUT_DIR]      # ~12 minutes (its steps' times added up); results JSON and logs in OUT_DIR
#
# Needs torch with CUDA and DeepSpeed importable; a DeepSpeed wheel built on a CPU-only machine records the CPU
# accelerator, so DS_ACCELERATOR defaults to cuda here. docs/gpus.md reads the results.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-benchmarks/results}")
mkdir -p "$out"
export DS_ACCELERATOR=${DS_ACCELERATOR:-cuda}
config=${ON_GPU_CONFIG:-ds_configs/gpu_bf16.json}   # the trainer's DeepSpeed config
status=0
step() {   # name, then the command; a failing step is reported and the next one still runs
  local name=$1
  shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -25 "$out/$name.log"
  echo "== $name: rc $rc, $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
}

if [ "${ON_GPU_TRAINER_ONLY:-0}" = 1 ]; then   # the trainer steps alone (how this script is tried on a CPU)
  only_trainer=1
else
  only_trainer=0
  python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" \
    || exit 2
fi
rm -f "$out"/trainer_bf16*.jsonl   # the trainer appends to its --metrics file
if [ "$only_trainer" = 0 ]; then
  step cuda_tests python -m pytest -q -ra -m gpu tests/test_gpu.py
  step gpu_slices python benchmarks/gpu_slices.py --json "$out/gpu_slices.json"
  step host_overhead python benchmarks/host_overhead.py --hidden 1024 --heads 16 --batch 8 --seq-len 1024 \
    --dtype bf16 --slices 1,4 --per-parameter-bf16 --json "$out/host_overhead.json"
  step compiled_steps python benchmarks/compiled_steps.py --hidden 1024 --heads 16 --batch 8 --seq-len 1024 \
    --dtype bf16 --json "$out/compiled_steps.json"
fi
ckpt=$(mktemp -d)
port=${ON_GPU_MASTER_PORT:-29500}   # the deepspeed launcher's rendezvous port (a test passes a free one)
# further trainer options for every trainer step (a test on the CPU passes a small model and corpus)
read -r -a trainer_args <<< "${ON_GPU_TRAINER_ARGS:-}"
trainer() {   # name, rendezvous port, then the run's own options
  local name=$1 rendezvous=$2
  shift 2
  step "$name" deepspeed --num_gpus 1 --master_port "$rendezvous" examples/train_gpt.py --deepspeed_config "$config" \
    --stages 1 --metrics "$out/$name.jsonl" "$@" "${trainer_args[@]}"
}
compile=(--compile "${ON_GPU_COMPILE_BACKEND:-inductor}")
side=""
if [ "${ON_GPU_CONCURRENT:-0}" = 1 ]; then
  # Where the timings mean nothing (the test that tries these steps on a CPU), the uninterrupted and compiled runs
  # go beside the save and resume, on a second port; on a GPU they run one after another, as timed.
  side_port=${ON_GPU_MASTER_PORT2:-$((port + 1))}
  (
    trainer trainer_bf16_whole "$side_port" --steps 30
    trainer trainer_bf16_compiled "$side_port" --steps 30 "${compile[@]}"
    exit $status
  ) > "$out/side_runs.out" 2>&1 &
  side=$!
fi
trainer trainer_bf16 "$port" --steps 20 --save-dir "$ckpt" --save-every 10
trainer trainer_bf16_resume "$port" --steps 30 --save-dir "$ckpt" --save-every 10 --resume
if [ -n "$side" ]; then
  wait "$side" || status=1
  cat "$out/side_runs.out"
else
  trainer trainer_bf16_whole "$port" --steps 30
fi
rm -rf "$ckpt"
step resume_vs_whole python - "$out/trainer_bf16_resume.jsonl" "$out/trainer_bf16_whole.jsonl" <<'PY'
import json, sys
resumed, whole = ({r["step"]: r["loss"] for r in map(json.loads, open(path))} for path in sys.argv[1:])
steps = sorted(set(resumed) & set(whole))
assert steps, "no common steps: did both runs write --metrics?"
worst = max(abs(resumed[s] - whole[s]) for s in steps)
print(f"steps {steps[0]}..{steps[-1]}: largest loss difference after the resume {worst:.3g} (CUDA reductions are not "
      "bit-deterministic run to run: compare with two uninterrupted runs' differences)")
PY
# the same trainer compiled (engine.compile, inductor): its ms/step beside the uncompiled run's, the losses alike
[ -n "$side" ] || trainer trainer_bf16_compiled "$port" --steps 30 "${compile[@]}"
step compiled_vs_whole python - "$out/trainer_bf16_whole.log" "$out/trainer_bf16_compiled.log" \
  "$out/trainer_bf16_whole.jsonl" "$out/trainer_bf16_compiled.jsonl" <<'PY'
import json, re, statistics, sys
whole_log, compiled_log, whole_jsonl, compiled_jsonl = sys.argv[1:]
ms = [[float(m) for m in re.findall(r"(\d+) ms/step", open(path).read())[1:]] for path in (whole_log, compiled_log)]
assert all(ms), "no ms/step lines after the first window in one of the logs"
whole, compiled = (statistics.median(m) for m in ms)
losses = [{r["step"]: r["loss"] for r in map(json.loads, open(path))} for path in (whole_jsonl, compiled_jsonl)]
steps = sorted(set(losses[0]) & set(losses[1]))
worst = max(abs(losses[0][s] - losses[1][s]) for s in steps)
print(f"ms/step (median of the logged windows after the first): uncompiled {whole:.0f}, compiled {compiled:.0f} "
      f"({whole / compiled:.2f}x); largest loss difference over steps {steps[0]}..{steps[-1]}: {worst:.3g}")
PY
exit $status
