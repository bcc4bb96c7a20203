"""What a CPU decode token reads its weights with: weights copied for inference on memory advised for huge pages
(the advice is read back from /proc/self/smaps), and a decode step's one-row products off oneDNN (restored after
the step, and never changed on another device)."""

from __future__ import annotations

import pytest
import torch

from runtime.inference.cpu_bandwidth import HUGE_PAGE, decode_kernels, empty_weight, huge_pages_available
from runtime.inference.load import open_checkpoint
from runtime.inference.offloaders import make_offloader
from runtime.inference.random_checkpoint import write_random_mixtral


def advised_huge(t: torch.Tensor) -> bool:
    """Whether the mapping that holds t's data carries MADV_HUGEPAGE (VmFlags `hg` in /proc/self/smaps)."""
    address, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                begin, end = (int(x, 16) for x in head.split("-"))
                inside = begin <= address < end
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()
    return False


needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="the kernel offers no transparent huge pages")


@needs_thp
def test_large_weights_go_on_huge_pages_and_small_ones_do_not():
    big = empty_weight((HUGE_PAGE // 2,), torch.bfloat16, "cpu")
    small = empty_weight((HUGE_PAGE // 4 - 1,), torch.bfloat16, "cpu")
    big.fill_(3)
    assert advised_huge(big) and not advised_huge(small)
    assert big.shape == (HUGE_PAGE // 2,) and float(big[-1]) == 3


@needs_thp
def test_a_checkpoint_placed_on_the_cpu_streams_its_weights_from_huge_pages(tmp_path):
    """Dense weights (the embedding, the head) and resident experts alike; auto's streamed experts stay in the
    checkpoint's mapped files."""
    write_random_mixtral(tmp_path / "m", hidden=256, ffn=1024, layers=2, experts=4, vocab=4096)
    loaded = open_checkpoint(tmp_path / "m")
    offloader = make_offloader(loaded.model, "none", torch.device("cpu"), source=loaded.experts)
    model = loaded.model
    assert advised_huge(model.tok_embeddings.weight) and advised_huge(model.output.weight)
    assert all(advised_huge(layer.experts.w1) for layer in model.moe_layers())
    offloader.close()


def test_a_decode_step_runs_without_onednn_and_restores_it():
    before = torch._C._get_mkldnn_enabled()
    with decode_kernels(torch.device("cpu")):
        assert not torch._C._get_mkldnn_enabled()
    assert torch._C._get_mkldnn_enabled() == before
    with pytest.raises(RuntimeError):
        with decode_kernels(torch.device("cpu")):
            raise RuntimeError("a failed step")
    assert torch._C._get_mkldnn_enabled() == before
    with decode_kernels(torch.device("meta")):
        assert torch._C._get_mkldnn_enabled() == before
