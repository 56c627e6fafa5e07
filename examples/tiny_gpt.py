"""A tiny GPT for examples and tests: pre-norm blocks, causal SDPA attention, tied embeddings.

Small enough to train a few steps on CPU (2 layers, width 64 by default). With ``position_ids``
(from ``wdsllm.loader(..., boundaries=True)``) positions restart at every document of a packed
row, and attention is block-diagonal causal: a token sees only earlier tokens of its own document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclass
class GPTConfig:
    vocab_size: int
    max_len: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    dropout: float = 0.0


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] boolean mask: query i may attend key j iff j <= i and both are in one document.

    A document starts wherever the position restarts at 0, so the segment of a token is the
    number of zeros up to and including it. Padding after a short row has position 0 everywhere,
    so each padding token is a segment of its own (it attends to itself only and is never a label).
    """
    segment = torch.cumsum((position_ids == 0).to(torch.int32), dim=1)
    same = segment.unsqueeze(2) == segment.unsqueeze(1)
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal).unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab]. With ``position_ids`` attention stays within documents."""
        t = input_ids.shape[1]
        if t > self.cfg.max_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's max_len {self.cfg.max_len}")
        if position_ids is None:
            pos = torch.arange(t, device=input_ids.device).unsqueeze(0)
            mask = None
        else:
            pos = position_ids
            mask = document_mask(position_ids)
        x = self.tok(input_ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token loss with labels aligned to the inputs (Hugging Face convention): the model
    shifts, so position t is scored against labels[t + 1]; -100 is ignored."""
    targets = labels[:, 1:].reshape(-1)
    total = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    # a batch without a single target (all padding) gives 0, not the NaN of an empty mean
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)
