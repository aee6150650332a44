"""Attention for draft heads and targets alike: grouped-query attention by the faster path for its shape.

On a CPU, torch's `scaled_dot_product_attention` is slow at the shapes decoding has: one query
token runs through its flash kernel, which parallelizes over query blocks and so does almost
nothing in parallel (Qwen2.5-0.5B's 14 query heads over 2 KV heads, bf16, 2 threads, AVX-512:
0.10 ms per layer at 100 cached tokens, 0.88 at 1,000, 2.2 at 2,000, against 0.055, 0.12 and 0.19
for two float32 matrix products over the grouped heads); a few query tokens (a draft tree being
verified) first copy every key and value once per query head (repeat_kv), and some sizes fall off
a cliff (float32, 300 cached tokens: 0.79 ms per layer for 5 queries, 0.14 for 8, against 0.095
and 0.12 grouped; docs/cpu-runtime.md). So on a CPU every shape goes through `grouped`: the query
heads that share a KV head are multiplied with it together, in float32, without copies.

specchat registers `grouped` with transformers' attention interface for its targets
(`specchat.decode.runtime.loading`); the heads here and specchat's own forward call `attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """Attention with the query heads grouped by the KV head they share (no repeat_kv). Float32 inside.

    query [b, heads, n, d]; key, value [b, kv_heads, L, d]; mask broadcastable to [b, 1, n, L]
    (boolean, True = may attend, or additive), or None: every query sees every key when n == 1,
    and causally (the last n keys are the queries') when n > 1. Returns [b, heads, n, d].
    """
    batch, heads, n, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if mask is None and n > 1:
        mask = torch.ones(n, length, dtype=torch.bool, device=query.device).tril(diagonal=length - n)
    # Head h reads KV head h // (heads // kv_heads), as in repeat_kv: one product per KV head with
    # all its query heads' rows [b, kv_heads, group * n, d] (a broadcast product would copy the keys).
    group = heads // kv_heads
    rows = query.reshape(batch, kv_heads, group * n, dim).float()
    scores = torch.matmul(rows, key.transpose(2, 3).float()) * scale  # [b, kv_heads, group * n, L]
    if mask is not None:
        mask = mask.reshape(mask.shape[0], 1, 1, *mask.shape[-2:]) if mask.dim() == 4 else mask
        scores = scores.view(batch, kv_heads, group, n, length)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:  # a row that may attend nothing (padding) gets zeros, as SDPA gives, not NaN
        probs = probs.nan_to_num(0.0)
    probs = probs.view(batch, kv_heads, group * n, length)
    return torch.matmul(probs, value.float()).to(query.dtype).reshape(batch, heads, n, dim)


def repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves `groups` query heads (as transformers'
    repeat_kv: an expanded view copied once, which a CUDA graph can capture)."""
    if groups == 1:
        return t
    batch, heads, length, dim = t.shape
    return t[:, :, None].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float | None = None) -> torch.Tensor:
    """Grouped-query attention ([b, heads, n, d] over [b, kv_heads, L, d]) by the faster path for its shape."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if query.device.type == "cpu":
        return grouped(query, key, value, mask, scale)
    groups = query.shape[1] // key.shape[1]  # (SDPA's own enable_gqa needs torch 2.5)
    return F.scaled_dot_product_attention(query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask,
                                          scale=scale)

