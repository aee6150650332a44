"""Attention for draft heads and targets alike: grouped-query attention by the faster path for its shape.

Plain decoding and the first step of every reply attend with one query token. On a CPU, torch's
`scaled_dot_product_attention` runs that shape through its flash kernel, which parallelizes over
query blocks and so does almost nothing in parallel: for Qwen2.5-0.5B's 14 query heads over 2 KV
heads (bf16, 2 threads, AVX-512 CPU) it takes 0.10 ms per layer at 100 cached tokens, 0.88 at
1,000 and 2.2 at 2,000, while two float32 matrix products over the grouped heads take 0.055, 0.12
and 0.19 ms (docs/cpu-runtime.md). At a 1,000-token context that is 18 ms of a 40 ms decode step.
For two or more query tokens (verifying a draft tree) SDPA is as fast or faster, so it stays.

specchat registers `one_query` with transformers' attention interface for its targets
(`specchat.decode.target`); the heads here call `attention` directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def one_query(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """Attention of one query token, the query heads grouped by the KV head they share (no repeat_kv).

    query [b, heads, 1, d]; key, value [b, kv_heads, L, d]; mask broadcastable to [b, 1, 1, L]
    (boolean, True = may attend, or additive). Returns [b, heads, 1, d]. Float32 inside.
    """
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    # Head h reads KV head h // (heads // kv_heads), as in repeat_kv.
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim).float()
    scores = torch.matmul(grouped, key.transpose(2, 3).float()) * scale  # [b, kv_heads, group, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, value.float()).to(query.dtype).reshape(batch, heads, 1, dim)


def repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves `groups` query heads."""
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float | None = None) -> torch.Tensor:
    """Grouped-query attention ([b, heads, n, d] over [b, kv_heads, L, d]) by the faster path for its shape."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if query.shape[2] == 1 and query.device.type == "cpu":
        return one_query(query, key, value, mask, scale)
    groups = query.shape[1] // key.shape[1]  # (SDPA's own enable_gqa needs torch 2.5)
    return F.scaled_dot_product_attention(query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask,
                                          scale=scale)

