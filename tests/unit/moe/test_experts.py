"""The decode forms of the routed experts give one set of numbers: the gathered per-token product (the reference,
`gather_routed_ffn`), the one-token grouped GEMM that reads the weights in place (`grouped_routed_ffn`) and the
per-row product on weights where they lie (`row_ffn`, offloaders' streamed experts), bit for bit."""

import pytest
import torch
from torch.profiler import profile

from runtime.moe.routed import (combine_choices, gather_routed_ffn, grouped_routed_ffn, one_token_in_place,
                                routed_ffn, row_ffn)

E = 8


def _weights(kind: str, bias: bool, dtype: torch.dtype, D: int = 256, F: int = 512) -> dict:
    torch.manual_seed(0)

    def make(*shape):
        return (torch.randn(*shape) / 16).to(dtype)

    swiglu = kind == "swiglu"
    return {"w1": make(E, F, D), "w2": make(E, D, F), "w3": make(E, F, D) if swiglu else None,
            "b1": make(E, F) if bias else None, "b2": make(E, D) if bias else None,
            "b3": make(E, F) if bias and swiglu else None}


CASES = [("swiglu", False, torch.bfloat16), ("swiglu", True, torch.float32), ("gelu", True, torch.bfloat16),
         ("gelu", False, torch.float32)]


@pytest.mark.parametrize("kind,bias,dtype", CASES)
def test_one_token_read_in_place_equals_the_gathered_product(kind, bias, dtype):
    w = _weights(kind, bias, dtype)
    generator = torch.Generator().manual_seed(1)
    for trial in range(12):
        k = 1 + trial % 3
        x = torch.randn(1, 1, 256, generator=generator).to(dtype)
        ids = torch.randperm(E, generator=generator)[:k].view(1, 1, k)
        gates = torch.softmax(torch.randn(1, 1, k, generator=generator), -1)
        assert one_token_in_place(x, w["w1"])
        assert torch.equal(grouped_routed_ffn(x, ids, gates, **w, kind=kind),
                           gather_routed_ffn(x, ids, gates, **w, kind=kind))


@pytest.mark.parametrize("kind,bias,dtype", CASES)
def test_rows_on_weights_where_they_lie_equal_the_gathered_product(kind, bias, dtype):
    """Two tokens (a batch the in-place grouped GEMM does not take), each choice one row_ffn on its expert."""
    w = _weights(kind, bias, dtype)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 1, 256, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=generator)[:2] for _ in range(2)]).view(2, 1, 2)
    gates = torch.softmax(torch.randn(2, 1, 2, generator=generator), -1)
    assert not one_token_in_place(x, w["w1"])
    pick = lambda e: {n: None if t is None else t[e] for n, t in w.items()}  # noqa: E731
    rows = [row_ffn(x[i // 2, 0][None], **pick(e), kind=kind) for i, e in enumerate(ids.reshape(-1).tolist())]
    ours = combine_choices(torch.cat(rows).view(2, 1, 2, -1), gates)
    assert torch.equal(ours, gather_routed_ffn(x, ids, gates, **w, kind=kind))
    assert torch.equal(routed_ffn(x, ids, gates, **w, kind=kind), ours)


def test_one_token_copies_no_expert_weights():
    """routed_ffn on one token gathers nothing by index: no aten::index, and no tensor the size of an expert."""
    w = _weights("swiglu", False, torch.float32)
    x, ids, gates = torch.randn(1, 1, 256), torch.tensor([[[5, 2]]]), torch.tensor([[[0.7, 0.3]]])
    with profile(profile_memory=True) as prof:
        routed_ffn(x, ids, gates, **w, kind="swiglu")
    names = {e.name for e in prof.events()}
    assert "aten::index" not in names and "aten::_grouped_mm" in names
    expert_bytes = 256 * 512 * 4
    assert max(e.cpu_memory_usage for e in prof.events()) < expert_bytes


def test_every_stand_in_is_on_the_declared_seam(tmp_path):
    """The resident experts and each offloader's stand-in are Experts; those a decode step runs are RoutedExperts."""
    from runtime.config import ModelConfig
    from runtime.inference.auto import StreamedExperts
    from runtime.inference.offload import LayerSlotExperts
    from runtime.inference.offloaders import make_offloader
    from runtime.model.transformer import Transformer
    from runtime.moe.experts import Experts, GroupedExperts, RoutedExperts
    from runtime.storage.offload_engine import OffloadedGroupedExperts

    assert all(issubclass(cls, Experts) for cls in (GroupedExperts, LayerSlotExperts, StreamedExperts,
                                                    OffloadedGroupedExperts))
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, vocab_size=64, ffn_hidden_size=32, num_experts=4,
                      top_k=2, max_seq_len=16)
    for mode, cls in (("none", GroupedExperts), ("ring", LayerSlotExperts), ("auto", StreamedExperts)):
        model = Transformer(cfg).eval()
        offloader = make_offloader(model, mode, torch.device("cpu"), 1, cache_dir=tmp_path / mode)
        experts = [layer.experts for layer in model.moe_layers()]
        assert any(isinstance(e, cls) for e in experts) and all(isinstance(e, RoutedExperts) for e in experts), mode
        offloader.close()
