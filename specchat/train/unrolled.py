"""Attention across unrolled draft steps, for training-time test (EAGLE-3, arXiv 2503.01840 §3.2).

The draft layer's `Attention` hands its queries, keys and values to this store instead of an
inference cache (`drafters.cache.HeadCache`); both implement `attend`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drafters.attention import repeat_kv


class UnrolledKeys:
    """Keys and values of earlier unrolled draft steps, for training-time test (EAGLE-3, §3.2).

    Step 0 runs over a whole sequence with causal attention. Step i >= 1 feeds each position the
    draft's own output of step i - 1 there and attends causally to step 0's keys plus, at the same
    position only, to the keys of steps 1..i: exactly what a depth-i tree node sees at inference
    (the committed context, its ancestors and itself). The same-position part is a dot product per
    position, so no [n, (i+1) n] mask is ever built.

    A batch of `rows` rows comes flattened, as the head's layers take it: position t of row b is
    entry b * width + t of the m = rows * width positions. A row may hold several sequences
    (`documents` [m] numbers them within their row): a position then attends only to its own
    sequence. Without `documents` a row is one sequence, right-padded. What is computed at padded
    positions is never trained on.
    """

    def __init__(self, rows: int = 1, documents: torch.Tensor | None = None):
        self.rows = rows
        self.steps: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.allowed = None  # [rows, 1, n, n]: causal, within a sequence (None: causal)
        self.blocked = None  # its complement, for the later steps' scores (made once, at the first)
        if documents is not None:
            documents = documents.view(rows, -1)
            n = documents.shape[1]
            causal = torch.ones(n, n, dtype=torch.bool, device=documents.device).tril()
            self.allowed = (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        """[1, h, rows * width, d] -> [rows, h, width, d]."""
        _, heads, m, dim = t.shape
        return t.view(heads, self.rows, m // self.rows, dim).transpose(0, 1)

    def attend(self, layer_idx: int, q, k, v, mask=None) -> torch.Tensor:
        """The draft layer's attention at this unrolled step (`mask` is implied, so unused)."""
        heads, m = q.shape[1], q.shape[2]
        q, k, v = self._split(q), self._split(k), self._split(v)
        earlier = self.steps.setdefault(layer_idx, [])
        earlier.append((k, v))
        groups = q.shape[1] // k.shape[1]
        k0, v0 = (repeat_kv(t, groups) for t in earlier[0])
        if len(earlier) == 1:
            out = F.scaled_dot_product_attention(q, k0, v0, attn_mask=self.allowed, is_causal=self.allowed is None)
        else:
            # The scores [rows, h, n, n + steps] are most of a training step's memory traffic on a GPU
            # (an H200's trace, docs/bench-gpu/h200-block4/): so the scale goes into q, the mask is
            # filled in place, the softmax widens to float32 itself, and the weights are split once
            # (a slice each would give every step's backward a zeroed copy of the whole per slice).
            n = q.shape[2]
            if self.blocked is None:
                self.blocked = ~self.allowed if self.allowed is not None else \
                    torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            q = q * q.shape[-1] ** -0.5
            later = [(repeat_kv(kj, groups), repeat_kv(vj, groups)) for kj, vj in earlier[1:]]
            scores0 = (q @ k0.transpose(-1, -2)).masked_fill_(self.blocked, float("-inf"))  # [rows, h, n, n]
            diagonal = torch.stack([(q * kj).sum(-1) for kj, _ in later], dim=-1)  # [rows, h, n, steps]
            weights = torch.softmax(torch.cat([scores0, diagonal], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
            weights0, *same_position = weights.split([n] + [1] * len(later), dim=-1)
            out = weights0 @ v0
            for weight, (_, vj) in zip(same_position, later):
                out = out + weight * vj
        return out.transpose(0, 1).reshape(1, heads, m, out.shape[-1])
