"""The two models of the equal-memory comparison (bench/peers.py) and of the footprint tests: written the way a
user would write them, outside coop_arena.examples. `gpt(...)` is a GPT-2-style decoder, `resnet(...)` a ResNet-style
CNN of BasicBlocks. Both expose `.blocks` (the units that checkpointing wraps)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class DecoderBlock(nn.Module):
    def __init__(self, d, heads, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.dropout = dropout

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, d)), self.dropout, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.dropout, self.training)


class GPT(nn.Module):
    def __init__(self, vocab=8192, d=256, heads=4, layers=6, seq=256, dropout=0.0):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(DecoderBlock(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.down(x))


class ResNet(nn.Module):
    def __init__(self, widths=(32, 64, 128, 256), classes=100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.stem(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x.mean(dim=(2, 3)))


def gpt(batch=8, seq=256, vocab=8192, d=256, heads=4, layers=6, seed=0):
    """(model, step inputs (idx, target), loss function) of the GPT-2-style decoder."""
    torch.manual_seed(seed)
    model = GPT(vocab, d, heads, layers, seq)
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, vocab, (batch, seq), generator=g)
    tgt = torch.randint(0, vocab, (batch, seq), generator=g)
    return model, (idx, tgt), lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def resnet(batch=32, size=64, widths=(32, 64, 128, 256), seed=0):
    """(model, step inputs (images, labels), loss function) of the ResNet-style CNN."""
    torch.manual_seed(seed)
    model = ResNet(widths)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, 100, (batch,), generator=g)
    return model, (x, y), F.cross_entropy


MODELS = {"gpt": gpt, "resnet": resnet}
