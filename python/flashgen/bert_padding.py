"""Padding helpers of `flash_attn.bert_padding`, for code that pairs them with the varlen functions:

    from flashgen.bert_padding import pad_input, unpad_input      # was: from flash_attn.bert_padding import ...
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out_unpad = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out = pad_input(out_unpad, indices, batch, seqlen)

Same names, arguments and results as flash_attn 2.6+ (unpad_input returns five values; 2.5 and older returned the
first four). Plain torch, differentiable, on any device. `unpad_input` reads the longest sequence's length on the
host (`max_seqlen` is a Python int, as the varlen functions take it): one device synchronization for CUDA masks,
as in flash_attn.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import validate

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input",
           "unpad_input_for_concatenated_sequences"]


def _tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _indices(indices, rows: int) -> torch.Tensor:
    """indices as int64; their values in [0, rows) where they are read (validate.indices_readable: CPU tensors, or
    FLASHGEN_CHECK_INDICES=1): torch's own errors named nothing, and a negative index wrapped to the last rows."""
    indices = _tensor("indices", indices)
    if indices.dim() != 1 or indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"indices: expected a 1-D int64 (or int32) tensor, got shape {tuple(indices.shape)} "
                         f"dtype {indices.dtype}")
    if indices.numel() and validate.indices_readable(indices):
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= rows:
            raise ValueError(f"indices: expected values in [0, {rows}) (the rows of the first axis), got values from "
                             f"{low} to {high}")
    return indices.long()


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:  # noqa: A002 (flash_attn's name)
    """input[indices] along the first axis: (first, ...) -> (len(indices), ...); the gradient is scattered back."""
    input = _tensor("input", input)
    if input.dim() < 1:
        raise ValueError("input: expected at least 1 dim")
    return input.index_select(0, _indices(indices, input.shape[0]).to(input.device))


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A zero tensor (first_axis_dim, ...) with values[i] at row indices[i]; the gradient is gathered back."""
    values = _tensor("values", values)
    if isinstance(first_axis_dim, bool) or not isinstance(first_axis_dim, int) or first_axis_dim < 0:
        raise ValueError(f"first_axis_dim: expected an int >= 0, got {first_axis_dim!r}")
    indices = _indices(indices, first_axis_dim).to(values.device)
    if values.dim() < 1 or values.shape[0] != indices.shape[0]:
        raise ValueError(f"values: expected {indices.shape[0]} rows (one per index), got shape {tuple(values.shape)}")
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


def _mask(name: str, mask, hidden_states: torch.Tensor) -> torch.Tensor:
    mask = _tensor(name, mask)
    if mask.dim() != 2 or tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"{name}: expected shape (batch, seqlen) = {tuple(hidden_states.shape[:2])} (the first two "
                         f"dims of hidden_states), got {tuple(mask.shape)}")
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"{name}: expected a bool or integer mask (1 = a real token), got {mask.dtype}")
    return mask.to(hidden_states.device)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """hidden_states (batch, seqlen, ...) and attention_mask (batch, seqlen), 1 where a token is real, to
    (hidden_states of the tokens kept (total, ...), their indices into the flattened (batch * seqlen) rows,
    cu_seqlens int32 (batch + 1), max_seqlen int, seqused int32 (batch)). unused_mask (batch, seqlen): tokens that are
    kept in the rows (counted by cu_seqlens) but not used (not counted by seqused); attention_mask and unused_mask
    must not overlap, as in flash_attn."""
    hidden_states = _tensor("hidden_states", hidden_states)
    if hidden_states.dim() < 2:
        raise ValueError(f"hidden_states: expected (batch, seqlen, ...), got shape {tuple(hidden_states.shape)}")
    used = _mask("attention_mask", attention_mask, hidden_states).bool()
    kept = used if unused_mask is None else used | _mask("unused_mask", unused_mask, hidden_states).bool()
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(rows, indices), indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of unpad_input: hidden_states (total, ...) of the kept tokens to (batch, seqlen, ...), zeros at
    the padding."""
    for name, value in (("batch", batch), ("seqlen", seqlen)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor
                                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Rows that hold several sequences each (packed samples): attention_mask_in_length (batch, seqlen) int gives,
    per row, the lengths of its sequences followed by zeros, e.g. [[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0]] for rows
    of 2 + 3 and 3 + 2 tokens (then padding). Returns (hidden_states of the tokens (total, ...), their indices into
    the flattened rows, cu_seqlens int32 over every sequence, max_seqlen int)."""
    hidden_states = _tensor("hidden_states", hidden_states)
    if hidden_states.dim() < 2:
        raise ValueError(f"hidden_states: expected (batch, seqlen, ...), got shape {tuple(hidden_states.shape)}")
    lengths_2d = _mask("attention_mask_in_length", attention_mask_in_length, hidden_states).long()
    if bool((lengths_2d < 0).any()):
        raise ValueError("attention_mask_in_length: expected lengths >= 0")
    seqlen = hidden_states.shape[1]
    per_row = lengths_2d.sum(dim=-1)
    if bool((per_row > seqlen).any()):
        raise ValueError(f"attention_mask_in_length: a row's lengths add up to more than seqlen {seqlen}")
    kept = torch.arange(seqlen, device=per_row.device).view(1, -1) < per_row.view(-1, 1)
    lengths = lengths_2d.flatten()
    lengths = lengths[lengths > 0].to(torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(rows, indices), indices, cu_seqlens, max_seqlen
