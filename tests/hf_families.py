"""Tiny random models of every released family moesys reads, built by transformers from its own config classes (no
download) and saved with `save_pretrained` in shards: what the family tests import, train, export, infer and serve."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from runtime.data.tokenizer import byte_tokenizer_json, hf_tokenizer_config

COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=128, tie_word_embeddings=False)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    # explicit head_dim apart from hidden / heads, one dense block of its own width, renormalised top-k
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=4, head_dim=32, norm_topk_prob=True, mlp_only_layers=[1])),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=4, pad_token_id=1,
                                  eos_token_id=2)),
    # q/k/v biases, MoE every 2nd block, a gated shared expert, raw top-k probabilities
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=48,
                                         decoder_sparse_step=2)),
    # MoE blocks 1..3, two shared experts, a score correction bias, interleaved RoPE, tied embeddings
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, moe_num_experts=8,
                                                moe_k=2, moe_num_shared_experts=2, moe_layer_start_index=1,
                                                moe_layer_end_index=3, tie_word_embeddings=True)),
}
TOKENS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))
"""A batch with no pad id in it (transformers' embedding never trains its padding row)."""
CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather?"},
     {"role": "assistant", "content": "Sunny and warm."}],
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi, how are you?"},
     {"role": "user", "content": "I am fine."}, {"role": "assistant", "content": "Good to hear."}],
    [{"role": "system", "content": "You count."}, {"role": "user", "content": "After three?"},
     {"role": "assistant", "content": "Four."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, like the sky."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Cats or dogs?"},
     {"role": "assistant", "content": "Cats."}, {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "Quiet."}],
    [{"role": "user", "content": "Is water wet?"}, {"role": "assistant", "content": "Yes, it is."}],
]
"""Conversations of system, user and assistant turns in ASCII (no byte below 3: no pad id among their tokens)."""


def write_chats(path: Path) -> Path:
    """CHATS as an OpenAI-messages .jsonl, a line each."""
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    return path


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def transformers_module():
    import transformers  # optional dependency: the tests that use these skip without it

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    return transformers


def family_config(family: str, **overrides):
    transformers = transformers_module()
    name, own = FAMILIES[family]
    return getattr(transformers, name)(**{**COMMON, **own, **overrides})


def tiny_model(family: str, seed: int = 0, **overrides):
    """A random transformers model of `family` in eval mode, its norms, biases and score bias drawn at random too (a
    swapped or missing one shows)."""
    transformers = transformers_module()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family, **overrides)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):  # attention biases and ERNIE's score correction
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def save_sharded(model, path: Path, tokenizer: bool = True) -> Path:
    """save_pretrained in shards of 100 KB (an index names them), with the byte tokenizer of its 256 rows (no special
    tokens: its stop ids are its generation_config.json's) and a chat template."""
    model.save_pretrained(path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    if tokenizer:
        (path / "tokenizer.json").write_text(byte_tokenizer_json(specials=False))
        template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}")
        (path / "tokenizer_config.json").write_text(json.dumps({**hf_tokenizer_config(128), "chat_template": template}))
    return path


OWN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>"
                "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %} {{ m['content'] }}"
                "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %} {% endif %}")
"""A released model's own chat template in Mixtral's shape: no ChatML marker, the tokenizer's bos and eos as template
variables."""
OWN_SPECIALS = ("<s>", "</s>", "<pad>", "<|end|>")
"""Ids 0..3 of `save_own_tokenizer`'s vocabulary: bos, eos, pad and a second stop token."""
OWN_STOPS = [1, 3]
"""The ids its generation_config.json ends generation at: eos and <|end|>."""


def save_own_tokenizer(path: Path, texts: list[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE of `vocab_size` ids trained on `texts`, saved by transformers' PreTrainedTokenizerFast with
    OWN_TEMPLATE, bos <s>, eos </s> and pad <pad> (tokenizer.json, tokenizer_config.json, chat_template.jinja), and a
    generation_config.json ending generation at OWN_STOPS: a released model's tokenizer that is not moesys's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    transformers = transformers_module()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(OWN_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    assert [bpe.token_to_id(t) for t in OWN_SPECIALS] == [0, 1, 2, 3]
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                         chat_template=OWN_TEMPLATE).save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=OWN_STOPS, pad_token_id=2).save_pretrained(path)
    return path


def load_transformers(path: Path, **kwargs):
    """transformers' own model of a saved directory, fp32, with its eager experts and attention (the reference)."""
    transformers = transformers_module()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager",
                                                             attn_implementation="eager", **kwargs).eval()
