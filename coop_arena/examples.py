"""Small real models for the demo, the tests and `coop-arena plan`: each exercises a different part of the
runtime (in-place activations, BatchNorm and residual writes, attention with views, dropout and weight
tying, a fused LSTM). `batch(name, step)` gives the same inputs for every run of a step."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """In-place ReLU after every Linear: recomputable in-place on every hidden activation."""

    def __init__(self, width=64, depth=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x), inplace=True)
        return self.head(x)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        out += x  # in-place residual add
        return F.relu(out, inplace=True)


class CNN(nn.Module):
    """BatchNorm (running statistics written once, Rule 5), residual in-place adds, max-pooling."""

    def __init__(self, c=8, blocks=6):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(*[Block(c) for _ in range(blocks)])
        self.pool = nn.MaxPool2d(2)
        self.more = nn.Sequential(*[Block(c) for _ in range(3)])
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = self.pool(self.blocks(self.stem(x)))
        x = self.more(x)
        return self.head(x.mean(dim=(2, 3)))


class Attention(nn.Module):
    def __init__(self, d, heads, sdpa):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:  # CPU builds its dropout mask as empty + bernoulli_ (a random in-place op)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
            y = att @ v
        return self.drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, d)))


class GPT(nn.Module):
    """Embedding, LayerNorm, causal attention with views and transposes, GELU, dropout, weight tying."""

    def __init__(self, vocab=64, d=32, heads=2, layers=3, seq=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList()
        for i in range(layers):
            self.blocks.append(nn.ModuleDict(dict(
                ln1=nn.LayerNorm(d), attn=Attention(d, heads, sdpa=i % 2 == 1), ln2=nn.LayerNorm(d),
                mlp=nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1)))))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = x + blk["attn"](blk["ln1"](x))
            x = x + blk["mlp"](blk["ln2"](x))
        return self.head(self.ln(x))


class LSTMNet(nn.Module):
    """Two stacked multi-layer LSTMs: on CUDA each is one cuDNN op whose backward holds all of its layers' state at
    once, so with a single LSTM the step's peak would be one op's working set, with nothing left to evict."""

    def __init__(self, inp=16, hidden=32, layers=3):
        super().__init__()
        self.lstm = nn.LSTM(inp, hidden, num_layers=layers, batch_first=True)
        self.lstm2 = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x):
        out, _ = self.lstm(x)
        out, _ = self.lstm2(torch.tanh(out))
        return self.head(out[:, -1])


def batch(name: str, step: int, device="cpu"):
    """(input, target) for a model, the same for every run of a given step."""
    g = torch.Generator().manual_seed(1234 + step)
    if name == "mlp":
        x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
    elif name == "cnn":
        x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
    elif name == "gpt":
        x = torch.randint(0, 64, (4, 16), generator=g)
        y = torch.randint(0, 64, (4, 16), generator=g)
    elif name == "lstm":
        x, y = torch.randn(8, 12, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
    else:
        raise ValueError(name)
    return x.to(device), y.to(device)


MODELS = {"mlp": MLP, "cnn": CNN, "gpt": GPT, "lstm": LSTMNet}


def loss_fn(name, out, y):
    if name == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


def example(name: str, batch_size: int):
    """(model, inputs) of an example model with `batch_size` samples (for `coop-arena plan`)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    x, _ = batch(name, 0)
    reps = -(-batch_size // x.shape[0])
    x = x.repeat(reps, *([1] * (x.dim() - 1)))[:batch_size]
    return model, (x,)
