"""Where experts lie and what they cost: bytes placed on the device count in the dtype they are placed in (bytes
read from the files in the stored one), streamed layers alone are marked for random access and still compute the
resident tokens, the per-layer store is rewritten when the placement dtype changes and is written atomically, and
the random Mixtral checkpoint is numbered from 1 as Hugging Face numbers shards."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.files import tensorfile
from runtime.inference.auto import AutoOffloader
from runtime.inference.generate import generate
from runtime.inference.load import open_checkpoint
from runtime.inference.mapped import read_header
from runtime.inference.offloaders import make_offloader
from runtime.inference.offload import LayerStore
from runtime.inference.random_checkpoint import write_random_mixtral

CPU = torch.device("cpu")
IDS = [[3, 14, 15, 92, 65, 35]]
LAYERS, EXPERTS, HIDDEN, FFN = 3, 4, 32, 48


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    write_random_mixtral(path, hidden=HIDDEN, ffn=FFN, layers=LAYERS, experts=EXPERTS, vocab=96, heads=4,
                         dtype=torch.bfloat16)
    return path


def test_shards_are_numbered_from_one_and_listed_in_the_index(mixtral):
    names = sorted(p.name for p in mixtral.glob("*.safetensors"))
    assert names == [f"model-{i:05d}-of-{LAYERS + 1:05d}.safetensors" for i in range(1, LAYERS + 2)]
    index = json.loads((mixtral / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(names)
    assert not [p for p in mixtral.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_bytes_placed_count_in_the_placement_dtype_and_bytes_read_in_the_stored_one(mixtral):
    loaded = open_checkpoint(mixtral, dtype=torch.float32)
    source = loaded.experts
    stored = 3 * HIDDEN * FFN * 2  # w1, w2, w3 in bf16
    assert source.expert_bytes(0, stored=True) == stored and source.expert_bytes(0) == 2 * stored
    offloader = AutoOffloader(loaded.model, CPU, source, num_slots=1)
    placed = sum(p.numel() * p.element_size() for p in loaded.model.moe_layers()[0].experts.parameters())
    assert placed == offloader.resident_bytes == EXPERTS * 2 * stored
    assert offloader.expert_host_bytes == (LAYERS - 1) * EXPERTS * stored  # the mapped files, as stored
    generate(loaded.model, IDS, 2, offloader=offloader)
    stats = offloader.stats()
    assert stats["store_bytes"] == stored * stats["inplace_computes"]
    offloader.close()


def test_only_streamed_layers_are_marked_for_random_access_and_tokens_are_unchanged(mixtral, monkeypatch):
    reference = open_checkpoint(mixtral)
    none = make_offloader(reference.model, "none", CPU, source=reference.experts)
    expected = generate(reference.model, IDS, 4, offloader=none).tokens
    none.close()

    loaded = open_checkpoint(mixtral)
    marked = []
    real = loaded.experts.files.random_access

    def record(tensors):
        tensors = list(tensors)
        marked.extend(tensors)
        real(tensors)

    monkeypatch.setattr(loaded.experts.files, "random_access", record)
    offloader = make_offloader(loaded.model, "auto", CPU, 1, source=loaded.experts)
    assert offloader.placement == ["resident", "inplace", "inplace"]
    streamed = {t.data_ptr() for m in (1, 2) for views in loaded.experts.layers[m].values() for t in views}
    assert {t.data_ptr() for t in marked} == streamed
    assert generate(loaded.model, IDS, 4, offloader=offloader).tokens == expected
    offloader.close()


def test_the_store_is_rewritten_when_the_placement_dtype_changes(mixtral, tmp_path):
    bf16 = open_checkpoint(mixtral).experts
    LayerStore.export(bf16, tmp_path, "same-checkpoint")
    assert read_header(tmp_path / "layer0.safetensors")[0]["w1"]["dtype"] == "BF16"
    fp32 = open_checkpoint(mixtral, dtype=torch.float32).experts
    LayerStore.export(fp32, tmp_path, "same-checkpoint")  # same fingerprint and shapes, another dtype
    assert read_header(tmp_path / "layer0.safetensors")[0]["w1"]["dtype"] == "F32"
    store = LayerStore(tmp_path, LAYERS)
    assert store.views(store.regions[0])["w1"].dtype == torch.float32


def test_a_failed_store_export_leaves_no_temporary_file(mixtral, tmp_path, monkeypatch):
    def fail(t):
        raise OSError("disk full")

    monkeypatch.setattr(tensorfile, "raw_bytes", fail)
    with pytest.raises(OSError, match="disk full"):
        LayerStore.export(open_checkpoint(mixtral).experts, tmp_path / "store")
    assert list((tmp_path / "store").iterdir()) == []
