"""The decoding loop's KV cache: transformers' `DynamicCache` whose full-attention layers keep
their keys and values in preallocated buffers, optionally in another dtype.

Why: transformers' `DynamicLayer` concatenates each step's keys onto the whole cache (a copy of
every cached position, per layer, per step), and the float32 attention of `entmtp.attention`
then casts every cached key and value from bf16 to float32 again each step. A growing buffer
writes only the new positions, and storing them in float32 (exact: a bf16 value is an fp32 one)
casts each once. Cropping and keeping an accepted tree path shrink a length, not tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .attention import FP32_SDPA


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` over buffers [B, H, capacity, D] that grow by doubling; `keys` and
    `values` are views of their first `length` positions, in `dtype` (None: the incoming one)."""

    def __init__(self, dtype: Optional[torch.dtype] = None, capacity: int = 256):
        self._keys = self._values = None
        super().__init__()
        self.store_dtype, self.capacity, self.length = dtype, capacity, 0

    # keys and values are sliced when read, so crops and tree steps only set a length (a view per
    # layer per step would cost more than the step's bookkeeping)
    @property
    def keys(self) -> Optional[torch.Tensor]:
        return None if self._keys is None else self._keys[:, :, : self.length]

    @keys.setter
    def keys(self, value) -> None:
        self._refuse_assignment(value)

    @property
    def values(self) -> Optional[torch.Tensor]:
        return None if self._values is None else self._values[:, :, : self.length]

    @values.setter
    def values(self, value) -> None:
        self._refuse_assignment(value)

    @staticmethod
    def _refuse_assignment(value) -> None:
        if value is not None:  # transformers' init and reset assign None
            raise NotImplementedError("a GrowingLayer's keys and values live in its buffers; they cannot be replaced")

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers [B, H, capacity, D] (positions from `length` on are free)."""
        return self._keys, self._values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        dtype = self.store_dtype or key_states.dtype
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self._keys = torch.empty(b, h, self.capacity, dk, dtype=dtype, device=self.device)
        self._values = torch.empty(b, h, self.capacity, dv, dtype=dtype, device=self.device)
        self.length = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states [B, H, q, D] -> all keys and values [B, H, length + q, D] (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        need = self.length + key_states.shape[-2]
        if need > self._keys.shape[-2]:
            grown = max(2 * self._keys.shape[-2], need)
            for name in ("_keys", "_values"):
                old = getattr(self, name)
                new = old.new_empty(*old.shape[:2], grown, old.shape[-1])
                new[:, :, : self.length] = old[:, :, : self.length]
                setattr(self, name, new)
        self._keys[:, :, self.length: need] = key_states
        self._values[:, :, self.length: need] = value_states
        self.length = need
        return self._keys[:, :, :need], self._values[:, :, :need]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove positions (transformers 5: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, not {tokens_to_remove}")
        if self.is_initialized and tokens_to_remove:
            self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self._keys = self._values = None
        self.length = 0
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("entmtp's decoding cache holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("entmtp's decoding cache holds one sequence")


def decoding_cache(model) -> DynamicCache:
    """A `DynamicCache` for `model` whose plain (full-attention) layers are `GrowingLayer`s,
    storing float32 when the model attends in float32 (`attention.FP32_SDPA`); sliding-window
    and other layer kinds stay transformers' own."""
    cache = DynamicCache(config=model.config)
    fp32 = getattr(model.config, "_attn_implementation", None) == FP32_SDPA
    dtype = torch.float32 if fp32 else None
    cache.layers = [GrowingLayer(dtype) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:  # a config without layer types: layers come lazily
        cache.layer_class_to_replicate = lambda: GrowingLayer(dtype)
    return cache


__all__ = ["GrowingLayer", "decoding_cache"]
