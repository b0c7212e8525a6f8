"""A small transformer encoder classifier over token sequences of variable length.

Inputs: ``tokens`` (int64, ``[batch, length]``) and ``mask`` (``[batch, length]``, 1 where a token is, 0 where the
batch was padded; the server builds it). Attention to padded positions is cut with an additive bias made in the
activations' own dtype from ``new_full(..., torch.finfo(dtype).min)``: the most negative value that dtype holds, so
a row of padding only (a batch's padded rows) still gives a finite, uniform softmax. A literal such as ``-1e9`` is
``-inf`` in fp16, and such a row would be NaN (the classic ``masked_fill(-1e9)`` overflow).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from halfserve.models.registry import register


def attention_bias(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, 1, length]``: 0 where ``mask`` has a token, the lowest finite value of ``like``'s dtype where not;
    on ``like``'s device and in its dtype."""
    real = mask.bool()[:, None, None, :]
    lowest = like.new_full(real.shape, torch.finfo(like.dtype).min)
    return lowest.masked_fill(real, 0.0)


class Block(nn.Module):
    """Pre-norm self-attention and feed-forward, each residual."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + bias
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
        x = x + self.out(attended)
        return x + self.ff(self.norm2(x))  # type: ignore[no-any-return]


@register("transformer_classifier")
class TransformerClassifier(nn.Module):
    """Token and position embeddings, ``layers`` encoder blocks, a mean over the real tokens, a linear head."""

    def __init__(
        self,
        vocab: int = 32,
        classes: int = 10,
        dim: int = 64,
        heads: int = 4,
        layers: int = 2,
        hidden: int = 128,
        max_length: int = 64,
    ) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(max_length, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``tokens``; without a ``mask`` (training on padded data), token 0 is padding."""
        if mask is None:
            mask = tokens != 0
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        bias = attention_bias(mask, x)
        for block in self.blocks:
            x = block(x, bias)
        weights = mask.to(x.dtype).unsqueeze(-1)
        pooled = (self.norm(x) * weights).sum(1) / weights.sum(1).clamp(min=1)
        return self.head(pooled)  # type: ignore[no-any-return]
