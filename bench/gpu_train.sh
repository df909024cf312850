#!/usr/bin/env bash
# How the shipped gemma-3-270m drafter was made on a lent CUDA GPU (drafters/README.md), time-boxed: the target
# makes data for DATA_S seconds (its greedy continuations of the corpus, -np sequences side by side), then the
# drafter trains for about TRAIN_S seconds on every sample made, and the last step is exported.
# Usage: bench/gpu_train.sh OUT TARGET.gguf CORPUS.jsonl   (CORPUS: `dflash-local corpus -o CORPUS.jsonl`)
# Environment: DATA_S TRAIN_S NP DEVICE NGL THREADS BATCH ANCHORS VARIANT SOFT (defaults below)
#
# Stage 1 is `dflash-local train`'s own data stage (traindata.make_data, with the arguments train passes it; train
# checks that in OUT/data/meta.json before it uses the data), run in a process without torch and with the native
# module loaded before numpy: on the GPU image this was run on (CUDA 13, PyTorch 2.11), a CUDA model loaded in a
# process that had imported numpy or torch first crashed (docs/gpu.md). For the same reason the training
# stage runs without held-out validation (--eval-every 0), which would load the target in the torch process.
set -euo pipefail
out=$1 target=$2 corpus=$3
DATA_S=${DATA_S:-420} TRAIN_S=${TRAIN_S:-390} NP=${NP:-128} DEVICE=${DEVICE:-cuda} NGL=${NGL:-99}
THREADS=${THREADS:-$(nproc)} BATCH=${BATCH:-16} ANCHORS=${ANCHORS:-64}
VARIANT=${VARIANT:-dflash} SOFT=${SOFT:-0}  # the shipped drafter's; the next run: VARIANT=dflash2 (docs/gpu.md)
layers=2,9,16 max_new=192

# 1. data: as many continuations as DATA_S seconds make (samples are written whole, so a stopped data stage keeps
#    every finished one)
timeout "$DATA_S" python3 -P - "$target" "$out/data" "$corpus" "$layers" "$max_new" "$NP" "$NGL" "$THREADS" <<'PY' || true
from dflash_local import _native  # noqa: F401  (first: see above)
import sys, time
from dflash_local.train.corpus import training_prompts
from dflash_local.engine.placement import Placement
from dflash_local.train.data import make_data

target, folder, corpus, layers, max_new, n_parallel, ngl, threads = sys.argv[1:]
t0, made = time.perf_counter(), [0]

def progress(i, n):
    made[0] += n
    if i % 200 == 0:
        print(f"data: sample {i}, {made[0]} tokens, {made[0] / (time.perf_counter() - t0):.0f} tokens/s", flush=True)

prompts = training_prompts(corpus, 0)
n = len(prompts) - 64  # the corpus's last prompts stay unseen: train validates on them (--eval-prompts)
make_data(target, folder, [int(x) for x in layers.split(",")], prompts[:n], n, int(max_new),
          n_parallel=int(n_parallel), progress=progress, placement=Placement(n_gpu_layers=int(ngl), n_threads=int(threads)))
PY
n=$(python3 -P -c "
import sys, pathlib
from dflash_local.train.data import sample_path
n = 0
while sample_path(pathlib.Path(sys.argv[1]), n).exists():
    n += 1
print(n)" "$out/data")
echo "gpu_train: $n samples"
[ "$n" -gt 0 ] || { echo "gpu_train: the data stage made no sample" >&2; exit 1; }

# 2. training: measure the step rate over 50 steps, then run as many steps as TRAIN_S allows
args=(-m "$target" -o "$out" --corpus "$corpus" --layers 2 --target-layers "$layers" --block-size 8 --draft-vocab 16384
      --max-new "$max_new" -np "$NP" -ngl "$NGL" -t "$THREADS" --device "$DEVICE" --batch "$BATCH" --anchors "$ANCHORS"
      --samples "$n" --eval-every 0 --variant "$VARIANT" --soft-labels "$SOFT")
t0=$(date +%s)
dflash-local train "${args[@]}" --steps 50
rate=$(python3 -c "import json, sys; print(json.loads(open(sys.argv[1]).readlines()[-1])['steps_per_s'])" \
       "$out/train.log.jsonl")
left=$(( TRAIN_S - ($(date +%s) - t0) ))
steps=$(python3 -c "print(max(100, int(50 + $rate * $left * 0.85) // 100 * 100))")
echo "gpu_train: $rate steps/s, training to step $steps"
dflash-local train "${args[@]}" --steps "$steps" --save-every 200
