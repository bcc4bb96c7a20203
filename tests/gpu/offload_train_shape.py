"""Offloaded training's GPU check in one call: `moesys bench offload-train`'s runs at its 2.43B Mixtral shape
(8 layers x 8 experts, H 2048, F 5632, bf16, 8,192 tokens a step), with fewer steps than the verb's default so that
it fits a short device lease. Usage: python tests/gpu/offload_train_shape.py LIMIT_S VARIANTS [key=value ...]."""

import json
import sys
import time

from moesys_cli.resolve import resolve_config
from runtime.bench.offload_train import run_offload_train_bench

SHAPE = ("recipe=tiny topology=local model=mixtral-8x7b model.num_layers=8 model.hidden_size=2048 "
         "model.num_heads=16 model.num_kv_heads=4 model.ffn_hidden_size=5632 model.max_seq_len=4096 "
         "train.precision=bf16 train.micro_batch_size=4 train.seq_len=2048 train.lr=1e-4").split()

if __name__ == "__main__":
    limit, variants = float(sys.argv[1]), tuple(sys.argv[2].split(","))
    start = time.monotonic()
    result = run_offload_train_bench(resolve_config(SHAPE + sys.argv[3:]), steps=8, warmup=3, time_limit_s=limit,
                                     variants=variants)
    print(json.dumps({**result, "wall_s": time.monotonic() - start}, indent=1))
