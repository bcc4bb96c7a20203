#!/usr/bin/env bash
# GPU validation on a lent device machine (the device tool's `run`), in calls of under 9 minutes each, most important
# first (a lease is 15 minutes of device time, starts included: G, then H, then E, then A, then C where time is left):
#   bash tests/gpu/device_validate.sh G   # decode's open question first: the compiled static step with its experts
#                                         # read in place (grouped GEMM) against gathered (coordinate-descent
#                                         # reductions), each with its CUDA profile, auto at 4 of 16 layers with its
#                                         # profile (where its CPU time goes), transformers' static cache
#   bash tests/gpu/device_validate.sh H   # fine-tuning: a Qwen3-30B-A3B-shaped model (real dims, 4 of its 48
#                                         # layers, random bf16 weights written by transformers) on chat data with
#                                         # recipe=finetune, storage none / cpu / cpu_delayed, each beside the plan
#   bash tests/gpu/device_validate.sh A   # env, tests/gpu, offload-train at its 2.43B Mixtral shape (also
#                                         # with as many MoE layers as the plan fits kept on the GPU)
#   bash tests/gpu/device_validate.sh E   # offloaded training's other GPU check: a model whose training states
#                                         # exceed the GPU (4 Mixtral layers, 5.6B expert parameters, 90 GB of
#                                         # states) with storage=cpu against its plan, and the 2.43B shape at alpha
#                                         # 0.25 (a one-token corpus: each layer's tokens all go to the same 2 of 8
#                                         # experts)
#   bash tests/gpu/device_validate.sh C   # decode's GPU checks in under 9 minutes: bench infer's systems at
#                                         # the 16-layer shape (K=4 of 16; tests/gpu/decode_shape.py: none, auto,
#                                         # transformers_static, accelerate, transformers, the compiled token's CUDA
#                                         # profile, each in its share of 370 s, a killed one reporting what it had
#                                         # measured), then bench serve (batched vs one at a time, 16 clients)
#   bash tests/gpu/device_validate.sh B   # bench moe-layer, ring, offload; tests/unit + tests/config
#   bash tests/gpu/device_validate.sh D   # pinned H2D bandwidth, tiny training none/cpu/ssd and a big model vs plan
#   bash tests/gpu/device_validate.sh F   # one call for a lease with little time: offload-train at the 2.43B shape
#                                         # with every MoE layer offloaded (8,192 and 32,768 tokens a step), then
#                                         # the static decode step at bench infer's large shape with its CUDA profile
# Needs hydra-core 1.3.2, omegaconf 2.3.0, antlr4-python3-runtime 4.9.3 as wheels in WHL (default .whl), carried.
# Logs: $OUT/logs-PART.tgz (re-packed after every step, so a killed call still returns what ran) and
# $OUT/summary-PART.txt (one line per step: name, exit status, seconds).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PART=${1:-A}
WHL=${WHL:-.whl}
OUT=${OUT:-/tmp/out}
L=/tmp/L
mkdir -p "$L" "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/bin
printf '#!/bin/sh\nexec python3 -c "import sys; from moesys_cli.app import main; sys.argv[0] = \\"moesys\\"; main()" "$@"\n' \
  > /tmp/bin/moesys
chmod +x /tmp/bin/moesys
export PATH=/tmp/bin:$PATH
R=/tmp/runs
mkdir -p $R

step() {  # step NAME TIMEOUT_S CMD...: log in $L/NAME.log, a summary line, logs re-packed into $OUT
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout -k 5 "$limit" bash -c "$*" >"$L/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc ${SECONDS}s_total $((SECONDS - t0))s" | tee -a "$OUT/summary-$PART.txt"
  tar -C "$L" -czf "$OUT/logs-$PART.tgz" .
}

TRAIN="moesys train recipe=tiny topology=local train.precision=bf16 train.log_every=10 train.checkpoint_every=0"
TRAIN="$TRAIN train.final_checkpoint=false --json"

if [ "$PART" = A ]; then
  step env 30 'nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"; moesys --help | head -5; nproc; free -g; df -h /tmp'
  step tests_gpu 150 'python3 -m pytest -p no:cacheprovider -q -rs tests/gpu tests/unit/train/test_worker_device.py'
  step offload_train 450 'python3 tests/gpu/offload_train_shape.py 420 none,cpu,cpu_delayed,ssd,cpu_fit_delayed'
elif [ "$PART" = D ]; then
  step h2d 60 'python3 - <<EOF
import torch, time
n = 1 << 30
src = torch.empty(n, dtype=torch.uint8).pin_memory()
dst = torch.empty(n, dtype=torch.uint8, device="cuda")
for pinned, s in (("pinned", src), ("pageable", torch.empty(n, dtype=torch.uint8))):
    dst.copy_(s, non_blocking=True); torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t = time.perf_counter(); dst.copy_(s, non_blocking=True); torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    print(pinned, "H2D GB/s per rep", [round(n / x / 1e9, 2) for x in times], "best", n / min(times) / 1e9)
t = time.perf_counter(); src.copy_(dst, non_blocking=True); torch.cuda.synchronize(); print("pinned D2H GB/s", n / (time.perf_counter() - t) / 1e9)
EOF'
  for mode in none cpu ssd; do
    step "train_$mode" 90 "$TRAIN storage=$mode train.max_steps=60 train.run_dir=$R/$mode && moesys plan --compare $R/$mode --json"
  done
  step train_ep2_cpu_procs 90 "$TRAIN topology=single train.max_steps=20 train.run_dir=$R/ep2cpu"  # 2 CPU ranks, GPU unused
  # 2 ranks on the one GPU: refused before launch (gpus_per_node > GPUs present); NCCL would refuse a duplicate GPU
  step train_ep2_one_gpu 30 "$TRAIN topology.detect=false topology.gpus_per_node=2 topology.gpu_memory_gb=80 topology.expert_parallel=2 train.max_steps=5 train.run_dir=$R/ep2gpu"
  BIG="model.hidden_size=2048 model.ffn_hidden_size=4096 model.num_experts=32 model.num_layers=6 model.num_heads=16"  # plan: ~53 GB on the GPU
  step plan_big 30 "moesys plan recipe=tiny topology=local train.precision=bf16 $BIG --json"
  step train_big 150 "$TRAIN $BIG train.max_steps=10 train.log_every=1 train.run_dir=$R/big && moesys plan --compare $R/big --json"
elif [ "$PART" = E ]; then
  BEYOND="model=mixtral-8x7b model.num_layers=4 model.max_seq_len=4096 train.micro_batch_size=2 train.seq_len=2048 train.lr=1e-4"
  step plan_beyond 30 "moesys plan recipe=tiny topology=local train.precision=bf16 $BEYOND storage=none; moesys plan recipe=tiny topology=local train.precision=bf16 $BEYOND storage=cpu --json"
  step train_beyond_none 60 "$TRAIN $BEYOND storage=none train.max_steps=2 train.run_dir=$R/beyond_none"  # refused: 145 GB
  step train_beyond_cpu 200 "$TRAIN $BEYOND storage=cpu train.max_steps=6 train.log_every=1 train.run_dir=$R/beyond && moesys plan --compare $R/beyond --json"
  python3 -c "open('/tmp/one_token.txt', 'w').write('a' * 400000)"
  step offload_train_alpha25 300 'python3 tests/gpu/offload_train_shape.py 280 none,cpu_delayed,cpu,ssd train.data=/tmp/one_token.txt'
elif [ "$PART" = F ]; then
  step env 20 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; nproc; free -g; df -h /tmp'
  step offload_8k 215 'python3 tests/gpu/offload_train_shape.py 190 none,cpu,cpu_delayed,ssd'
  step offload_32k 130 'python3 tests/gpu/offload_train_shape.py 110 none,cpu_delayed train.micro_batch_size=16'
  step decode_large 225 'python3 tests/gpu/decode_shape.py 205 none,profile,auto,transformers 4'
elif [ "$PART" = G ]; then
  step env 15 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g'
  step decode_forms 540 'python3 tests/gpu/decode_shape.py 520 none,none_gather,profile,profile_gather,auto,profile_auto,transformers_static 4'
elif [ "$PART" = H ]; then
  step env 15 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g; df -h /tmp'
  step finetune_qwen3 480 'python3 tests/gpu/finetune_shape.py 450 4 none,cpu,cpu_delayed'
elif [ "$PART" = C ]; then
  step env 15 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g'
  step decode_large 390 'python3 tests/gpu/decode_shape.py 370 none,auto,transformers_static,accelerate,transformers,profile 4'
  step bench_serve 115 'moesys bench serve --json'
else
  step bench_moe_layer 180 'moesys bench moe-layer --json'
  step bench_ring 150 'moesys bench ring --json'
  step bench_offload 150 'moesys bench offload --json'
  step tests_unit 200 'python3 -m pytest -p no:cacheprovider -q -x -n 8 tests/unit tests/config'
fi
cat "$OUT/summary-$PART.txt"
