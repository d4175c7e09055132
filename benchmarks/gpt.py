"""A plain GPT, the model our users would otherwise train: the peer baseline of `make bench-peer`.

Standard pre-norm decoder-only transformer: token + learned position embeddings (or, with
`positions="rotary"`, no position embedding and ced's rotary embedding on q and k), per block
LayerNorm -> causal multi-head self-attention (torch's scaled_dot_product_attention) -> residual,
LayerNorm -> GELU MLP of width 4 * d_model -> residual; final LayerNorm and an untied LM head.
Written for this benchmark only; nothing in `ced` depends on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ced.semantics import rotary


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 259
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 16
    max_seq_len: int = 2048
    positions: str = "learned"      # learned | rotary (benchmarks/learning.py compares them)


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.rotary = cfg.positions == "rotary"
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        """x [B, T, D] -> [B, T, D], causal."""
        b, t, d = x.shape
        q, k, v = (part.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for part in self.qkv(x).split(d, dim=-1))
        if self.rotary:
            positions = torch.arange(t, device=x.device)
            q, k = rotary(q, positions, 10000.0), rotary(k, positions, 10000.0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.positions not in ("learned", "rotary"):
            raise ValueError(f"GPTConfig.positions must be learned or rotary, got {cfg.positions!r}")
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.positions == "learned" \
            else None
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # residual output projections scaled with depth, as GPT-2 does
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("proj.weight",
                                                                           "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward_flops(self, seq_len: int, counting: str = "causal") -> int:
        """Matrix-multiply FLOPs (2 per multiply-add, as ced.cost counts) of forward() on one
        sequence of seq_len tokens: the projections, MLPs and LM head, plus attention's QK and
        PV products over the keys each query sees (`causal`: T (T + 1) / 2 pairs per layer and
        head, what the fused causal kernel needs) or over the whole T x T `rectangle` (what
        SDPA's math backend multiplies, so FlopCounterMode can check it)."""
        if counting not in ("causal", "rectangle"):
            raise ValueError(f"counting must be causal or rectangle, got {counting!r}")
        d, t, cfg = self.cfg.d_model, seq_len, self.cfg
        per_token = cfg.n_layers * (3 * d * d + d * d + 2 * 4 * d * d) + d * cfg.vocab_size
        pairs = t * (t + 1) // 2 if counting == "causal" else t * t
        return 2 * t * per_token + cfg.n_layers * 2 * 2 * d * pairs

    def forward(self, ids: Tensor) -> Tensor:
        """ids [B, T] -> logits [B, T, V]."""
        t = ids.shape[1]
        h = self.tok(ids)
        if self.pos is not None:
            h = h + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))
