"""flash_attn.utils.generation's InferenceParams: the state a model's layers share while generating (flashgen's own
generation loop is not provided; flashgen.nn.KVCache is its KV cache for models written against flashgen)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["InferenceParams"]


@dataclass
class InferenceParams:
    """max_seqlen / max_batch_size size each layer's cache (flashgen.modules.mha.MHA makes it in
    key_value_memory_dict[layer_idx] on first use); seqlen_offset is the tokens already in the cache (0 for the
    prompt), which the caller advances after each forward; batch_size_offset the first cache row of this batch;
    lengths_per_sample, int32 (max_batch_size,) indexed by cache row, each row's own length where rows differ (read
    instead of seqlen_offset by the flash path's decode steps and rotary; the torch path refuses lengths other than
    seqlen_offset where it reads them: CPU tensors, or FLASHGEN_CHECK_INDICES=1 on a device)."""

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Optional[torch.Tensor] = None

    def reset(self, max_seqlen: int, max_batch_size: int) -> None:
        """Start a new generation: new sizes, offset 0, lengths zeroed in place (the caches are kept and reused)."""
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()
