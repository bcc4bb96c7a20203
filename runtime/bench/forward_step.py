"""The baseline `moesys bench infer` measures the static decode step against (`moesys_none_forward`): each decode
token through the model's forward, as a prompt runs."""

from __future__ import annotations

from torch import Tensor

from runtime.inference.cpu_bandwidth import decode_kernels
from runtime.inference.decode import DecodeStep
from runtime.model.attention import StaticKVCache
from runtime.model.transformer import Transformer


class ForwardStep(DecodeStep):
    """Each decode token through the model's forward: sort-based expert dispatch (row counts read on the host), the
    position a host int; on the same cache and weights as the static step."""

    def __init__(self, model: Transformer):
        super().__init__(model)
        self.position = 0

    def prefill(self, tokens_BS: Tensor, cache: StaticKVCache) -> Tensor:
        self.position = tokens_BS.shape[1]
        return super().prefill(tokens_BS, cache)

    def __call__(self, tokens_B1: Tensor, pos_1: Tensor, cache: StaticKVCache) -> Tensor:
        with decode_kernels(self.device):
            logits_BV = self.model(tokens_B1, cache, self.position).logits[:, -1]
        self.position += 1
        return logits_BV
