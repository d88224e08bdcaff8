"""A byte-level GPT on the Python standard library's own sources, as a dynabatch task.

    dynabatch run --task examples/byte_gpt.py:task --workers 3 --slowdowns 1 2 4

Text that every machine with Python already has: the standard library's `.py`
files (sorted by path, concatenated, cut at GPT_BYTES), the first 90 % for
training and the rest for evaluation. A sample is a window of GPT_CONTEXT bytes
and the same window shifted by one, the bytes to predict; windows do not overlap.
The model is a small decoder-only transformer: learned token and position
embeddings, pre-LayerNorm blocks of causal self-attention (torch's
`scaled_dot_product_attention`) and an MLP, a final LayerNorm, a linear head over
the 256 byte values (tied to the token embedding with GPT_TIE=1). AdamW with no
weight decay on biases, norms and embeddings, warm-up cosine, gradients clipped
to norm 1. The metric is bits per byte, the mean cross-entropy in bits: 8 is a
uniform guess.

The task file is loaded by every worker process, so its knobs are environment
variables, which `dynabatch run` hands to the processes it starts:
  GPT_BYTES    bytes of source text, train and evaluation together (4,000,000)
  GPT_CONTEXT  bytes per sample (128)
  GPT_WIDTH    embedding width (256)
  GPT_LAYERS   transformer blocks (4)
  GPT_HEADS    attention heads (4; must divide GPT_WIDTH)
  GPT_TIE      1: the output head shares the token embedding's weight (0)
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import dynabatch as db

TEXT_BYTES = int(os.environ.get("GPT_BYTES", "4000000"))
CONTEXT = int(os.environ.get("GPT_CONTEXT", "128"))
WIDTH = int(os.environ.get("GPT_WIDTH", "256"))
LAYERS = int(os.environ.get("GPT_LAYERS", "4"))
HEADS = int(os.environ.get("GPT_HEADS", "4"))
TIE = os.environ.get("GPT_TIE", "0") == "1"
EVAL_FRACTION = 0.1
VOCAB = 256


def stdlib_text(limit: int = TEXT_BYTES) -> bytes:
    """The first `limit` bytes of the standard library's `.py` files, sorted by path: the same text on every machine
    with the same Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if total >= limit:
            break
        data = path.read_bytes()
        parts.append(data)
        total += len(data)
    text = b"".join(parts)[:limit]
    if len(text) < 2 * (CONTEXT + 1) / EVAL_FRACTION:
        raise ValueError(f"{len(text)} bytes of text under {root} are too few for GPT_CONTEXT={CONTEXT}")
    return text


class ByteWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of a byte string: (context [T], next bytes [T]) as int64."""

    def __init__(self, text: bytes, context: int = CONTEXT) -> None:
        self.bytes = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self.context = context

    def __len__(self) -> int:
        return (len(self.bytes) - 1) // self.context

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.context
        window = self.bytes[start : start + self.context + 1].long()
        return window[:-1], window[1:]


_text: dict[str, bytes] = {}


def split(train: bool) -> ByteWindows:
    """The training (first 90 %) or evaluation (last 10 %) part of the text; read once per process."""
    if "all" not in _text:
        _text["all"] = stdlib_text()
    text = _text["all"]
    cut = int(len(text) * (1 - EVAL_FRACTION))
    return ByteWindows(text[:cut] if train else text[cut:])


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.proj(out.transpose(1, 2).reshape(b, t, c))
        return projected


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class ByteGPT(nn.Module):
    """Logits [B, T, 256] for every position of a byte sequence [B, T], each from the bytes up to it."""

    def __init__(
        self, width: int = WIDTH, layers: int = LAYERS, heads: int = HEADS, context: int = CONTEXT, tie: bool = TIE
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"GPT_WIDTH={width} is not a multiple of GPT_HEADS={heads}")
        self.tok_emb = nn.Embedding(VOCAB, width)
        nn.init.normal_(self.tok_emb.weight, std=0.02)  # GPT-2's scale: as a tied head, N(0, 1) gives huge first logits
        self.pos_emb = nn.Parameter(torch.zeros(context, width))
        nn.init.normal_(self.pos_emb, std=0.02)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        if tie:
            self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        logits: torch.Tensor = self.head(self.norm_f(self.blocks(x)))
        return logits


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean cross-entropy (nats) of every next byte in the batch."""
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def bits_per_byte(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Cross-entropy in bits, summed over the batch's predicted bytes, with their count."""
    x, y = batch
    nats = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
    return {"bits_per_byte": (float(nats) / math.log(2), float(y.numel()))}


task = db.Task(
    model=ByteGPT,
    train_data=lambda: split(train=True),
    eval_data=lambda: split(train=False),
    loss=loss,
    metrics=[bits_per_byte],
    optimizer=db.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, no_decay=("bias", "norm", "emb")),
    schedule=db.schedule.warmup_cosine(warmup=0.05),
    clip_grad_norm=1.0,
    name="byte-level GPT on the Python standard library",
)
