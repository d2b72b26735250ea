"""A nanoGPT-shaped model small enough for every test: token and position embeddings, one
attention block with a causal-mask buffer, and an output head tied to the token embedding
(``lm_head.weight is wte.weight``), as nanoGPT and GPT-2 have it."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, WIDTH, CONTEXT = 16, 8, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)
        mask = torch.tril(torch.ones(CONTEXT, CONTEXT)).view(1, CONTEXT, CONTEXT)
        self.register_buffer("bias", mask)  # persistent: in state_dict(), as in nanoGPT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(self.ln(x)).split(WIDTH, dim=2)
        att = (q @ k.transpose(1, 2)) / WIDTH**0.5
        att = att.masked_fill(self.bias[:, : x.shape[1], : x.shape[1]] == 0, float("-inf"))
        return x + self.c_proj(att.softmax(-1) @ v)


class TinyGPT(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.h = Block()
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        return self.lm_head(self.ln_f(self.h(self.wte(idx) + self.wpe(pos))))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def optimizers(named: list[tuple[str, nn.Parameter]]) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon for the hidden matrices, AdamW for embeddings, head and vectors."""
    hidden = [(n, p) for n, p in named if p.ndim == 2 and ".h." in f".{n}"]
    rest = [(n, p) for n, p in named if not (p.ndim == 2 and ".h." in f".{n}")]
    return [
        torch.optim.Muon(hidden, lr=0.02, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=0.01),
    ]


def train(model: nn.Module, opts: list[torch.optim.Optimizer], first: int, steps: int) -> None:
    for step in range(first, first + steps):
        x, y = batch(step)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        model.zero_grad()
        loss.backward()
        for opt in opts:
            opt.step()
