"""The per-block masks of `ced.attention.attend`'s key sets: which keys (window keys, global
entries, top-k slots) each query of a query block may not read, True where hidden. Each is a
function of tensors the layers of one forward or engine call share, so `attend` builds it once
a call (`ced.attention.shared`). Which positions a query sees at all is ced/semantics.py's; these
turn it into one block's masks for the three reads of docs/semantics.md 3.4.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .semantics import visible_entries


def chosen_mask(index: Tensor, valid: Tensor, n_read: int) -> Tensor:
    """Selected entries as a mask: index/valid [B, C, k] -> BoolTensor[B, C, n_read]. Padding
    slots (valid False) go to a spare column that is cut off, so they never mark an entry."""
    spare = torch.full_like(index, n_read)
    target = torch.where(valid, index, spare).clamp_max(n_read)
    mask = torch.zeros(*index.shape[:2], n_read + 1, dtype=torch.bool, device=index.device)
    return mask.scatter_(-1, target, True)[..., :n_read]


def window_block(lower: Tensor, key_positions: Tensor, query_positions: Tensor, c0: int,
                 c1: int) -> tuple[int, int, Tensor]:
    """The window keys of queries c0:c1: window keys at ascending key_positions [S], lower
    [B|1, Tq] (`window_lower_bound`), query_positions [Tq] -> (first, last): the rows
    first:last of the keys that some query of the block sees, and hidden [B|1, 1, C, last -
    first]: key p hidden from query i unless lower(i) <= p <= i."""
    low, qpos = lower[:, c0:c1], query_positions[c0:c1]
    first = int(torch.searchsorted(key_positions, low.min()))
    last = int(torch.searchsorted(key_positions, qpos[-1], right=True))
    kpos = key_positions[first:last]
    hidden = (kpos[None, None, :] < low[:, :, None]) | (kpos[None, None, :] > qpos[None, :, None])
    return first, last, hidden[:, None]


def unpicked_entries(index: Tensor, valid: Tensor, c0: int, c1: int, n_read: int) -> Tensor:
    """A masked top-k read of queries c0:c1: the selection's index/valid [B, Tq, k] ->
    hidden [B, 1, C, n_read], every entry the query did not pick."""
    return ~chosen_mask(index[:, c0:c1], valid[:, c0:c1], n_read)[:, None]


def union_of_picks(index: Tensor, valid: Tensor, c0: int, c1: int, n_read: int,
                   kv_heads: int, n_entries: int) -> tuple[Tensor, Tensor, Tensor]:
    """A union top-k read of queries c0:c1: the entries some query of the block picked, per
    batch row, in ascending order and padded to the longest row's count U with entries no
    query picked. index/valid [B, Tq, k] -> (union [B, U], the entries' rows in the global K/V
    flattened [B * kv_heads * n_entries, Dh] as [B * kv_heads * U], hidden [B, 1, C, U]: every
    union entry the query did not pick, and the padding)."""
    chosen = chosen_mask(index[:, c0:c1], valid[:, c0:c1], n_read)          # [B, C, n_read]
    used = chosen.any(dim=1)                                                  # [B, n_read]
    width = int(used.sum(dim=-1).max()) if used.numel() else 0
    # a stable sort of "not used" puts the used entries first, each row in ascending order
    union = torch.sort((~used).to(torch.uint8), dim=-1, stable=True).indices[:, :width]
    b = index.shape[0]
    heads = torch.arange(b * kv_heads, device=index.device).view(b, kv_heads, 1)
    rows = (heads * n_entries + union[:, None, :]).reshape(-1)
    picked = torch.gather(chosen, -1, union[:, None, :].expand(-1, chosen.shape[1], -1))
    return union, rows, ~picked[:, None]


def empty_slots(valid: Tensor, c0: int, c1: int) -> Tensor:
    """A gathered top-k read of queries c0:c1: valid [B, Tq, k] -> hidden [B, 1, C, k], the
    padding slots."""
    return ~valid[:, c0:c1][:, None]


def invisible_entries(query_positions: Tensor, compress_ratio: int, first_entry: Tensor | None,
                      c0: int, c1: int, n_read: int) -> Tensor:
    """A dense global read of queries c0:c1 at query_positions [Tq]: hidden [B|1, 1, C, n_read],
    the entries not yet complete (`visible_entries`) and, under a document mask first_entry
    [B, Tq] (`first_visible_entry`), those before the query's document."""
    entry = torch.arange(n_read, device=query_positions.device)
    n_visible = visible_entries(query_positions[c0:c1], compress_ratio)
    hidden = (entry[None, :] >= n_visible[:, None])[None, None]
    if first_entry is not None:
        hidden = hidden | (entry < first_entry[:, c0:c1, None])[:, None]
    return hidden
