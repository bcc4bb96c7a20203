"""Fine-tuning a released family's shape on one GPU in one call: a Qwen3-30B-A3B-shaped model (its real dims,
LAYERS of its 48 layers, random weights that transformers draws and saves in bf16) trained on chat data with
`recipe=finetune`, as `moesys bench offload-train`'s timed jobs (tokens/s, MFU, the step's bound), each beside the
plan's memory (`moesys plan --compare`). Usage: python tests/gpu/finetune_shape.py LIMIT_S LAYERS VARIANTS
[key=value ...], VARIANTS a comma list of offload-train's (none, cpu, cpu_delayed, ...); LAYERS=tiny runs the same at
toy dims, which is how the script is checked without a GPU (tests/unit/train/test_finetune_shape.py)."""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                     router_aux_loss_coef=0.001, tie_word_embeddings=False)
"""Qwen3-30B-A3B's config.json, as the Hub writes it, but for the number of layers."""
TINY = dict(QWEN3_30B_A3B, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, vocab_size=512,
            max_position_embeddings=512)
TRAIN = {"real": ["train.seq_len=2048", "train.micro_batch_size=4", "train.precision=bf16"],
         "tiny": ["train.seq_len=64", "train.micro_batch_size=2"]}
"""Each size's batch: 8,192 tokens a step at the real dims."""
WORDS = ("the expert router sends each token to eight of its experts and the host keeps their states while the "
         "device computes").split()


def write_model(path: Path, layers: int | None) -> int:
    """A random Qwen3-MoE of `layers` layers at the real dims (None: TINY's dims and 2 layers) saved by transformers
    in bf16 shards -> its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**(QWEN3_30B_A3B if layers else TINY), num_hidden_layers=layers or 2)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="4GB")
    return sum(p.numel() for p in model.parameters())


def write_chats(path: Path, count: int) -> Path:
    """`count` conversations (system, user and assistant turns of random words) as OpenAI-messages .jsonl."""
    rng = random.Random(0)
    say = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    with path.open("w") as f:
        for _ in range(count):
            turns = [{"role": "system", "content": say(8)}]
            for _ in range(rng.randint(1, 3)):
                turns += [{"role": "user", "content": say(rng.randint(10, 60))},
                          {"role": "assistant", "content": say(rng.randint(20, 200))}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def main(limit_s: float, layers: str, variants: tuple[str, ...], overrides: list[str]) -> dict:
    from moesys_cli.resolve import resolve_config
    from runtime.bench.offload_train import run_offload_train_bench
    from runtime.plan.compare import compare_run, comparison_to_dict

    start = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="moesys-finetune-shape-"))
    try:
        real = layers != "tiny"
        out: dict = {"layers": int(layers) if real else 2, "dims": "qwen3-30b-a3b" if real else "tiny"}
        out["parameters"] = write_model(root / "model", int(layers) if real else None)
        out["write_s"] = time.monotonic() - start
        print("model", json.dumps(out), flush=True)
        chats = write_chats(root / "chats.jsonl", 4000 if real else 200)
        args = ["recipe=finetune", "topology=local", f"train.init_from={root / 'model'}", f"train.data={chats}",
                *TRAIN["real" if real else "tiny"], *overrides]
        cfg = resolve_config(args)
        left = limit_s - (time.monotonic() - start)
        out["bench"] = run_offload_train_bench(cfg, steps=8, warmup=3, time_limit_s=left, variants=variants,
                                               workdir=root / "runs")
        out["plan_compare"] = {name: comparison_to_dict(root / "runs" / name, compare_run(root / "runs" / name))
                               for name in variants if (root / "runs" / name / "metrics.jsonl").exists()}
        out["wall_s"] = time.monotonic() - start
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    result = main(float(sys.argv[1]), sys.argv[2], tuple(sys.argv[3].split(",")), sys.argv[4:])
    print(json.dumps(result, indent=1))
