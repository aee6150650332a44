"""What every target cache shares: the causal mask of new positions over cached ones.

The caches themselves: `specchat.decode.runtime.forward.LayerKV` for specchat's own forward,
`specchat.decode.runtime.transformers_cache.KVCache` for transformers' (kept apart, so that a
target that runs specchat's forward does not import transformers).
"""

from __future__ import annotations

import torch


def causal_mask(cached: int, new: int, device) -> torch.Tensor:
    """[1, 1, new, cached + new] (True = may attend): everything cached plus the causal triangle of the new positions."""
    mask = torch.ones(new, cached + new, dtype=torch.bool, device=device)
    mask[:, cached:] = torch.ones(new, new, dtype=torch.bool, device=device).tril()
    return mask[None, None]
