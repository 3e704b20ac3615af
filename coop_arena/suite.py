"""The Coop paper's nine workloads, at the paper's batch sizes, built on the `meta` device from configs: no
weights, no downloads, no data. ResNet-50/152, Inception V3, DenseNet-121 and Swin-T come from torchvision,
BERT-Large and GPT-2 from transformers (the optional extra `coop-arena[models]`); U-Net and the BiLSTM are
written here from their standard descriptions.

Every entry is a factory `f(batch) -> (model, inputs)` whose model returns one tensor: the loss for the language
models (labels are the inputs), the logits otherwise; a step is `model(*inputs).float().sum().backward()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class DoubleConv(nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    """U-Net (Ronneberger et al. 2015) with padded convolutions and BatchNorm, as commonly trained for
    segmentation: four 2x down-samplings from 64 to 1024 channels, transposed-convolution up-sampling, skip
    connections concatenated after padding the up-sampled map to the skip's size (odd sizes such as 460)."""

    def __init__(self, in_channels: int = 3, classes: int = 2, width: int = 64):
        super().__init__()
        chans = [width * 2**i for i in range(5)]
        self.inc = DoubleConv(in_channels, chans[0])
        self.downs = nn.ModuleList(DoubleConv(chans[i], chans[i + 1]) for i in range(4))
        self.ups = nn.ModuleList(nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2) for i in reversed(range(4)))
        self.up_convs = nn.ModuleList(DoubleConv(chans[i + 1], chans[i]) for i in reversed(range(4)))
        self.outc = nn.Conv2d(chans[0], classes, 1)

    def forward(self, x):
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(F.max_pool2d(skips[-1], 2)))
        x = skips.pop()
        for up, conv in zip(self.ups, self.up_convs):
            skip = skips.pop()
            x = up(x)
            dy, dx = skip.shape[2] - x.shape[2], skip.shape[3] - x.shape[3]
            x = F.pad(x, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
            x = conv(torch.cat([skip, x], dim=1))
        return self.outc(x)


class BiLSTM(nn.Module):
    """A bidirectional LSTM layer over the sequence, classifying from the last step of both directions."""

    def __init__(self, inp: int = 100, hidden: int = 256, layers: int = 1, classes: int = 10):
        super().__init__()
        self.lstm = nn.LSTM(inp, hidden, num_layers=layers, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class LanguageModelLoss(nn.Module):
    """A transformers masked or causal LM whose labels are its inputs; returns the loss."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids, labels=ids).loss


def _images(batch: int, size: int | tuple[int, int] = 224):
    h, w = (size, size) if isinstance(size, int) else size
    return (torch.empty(batch, 3, h, w, device="meta"),)


def _torchvision(name: str, **kwargs):
    def build(batch: int):
        import torchvision  # the optional extra coop-arena[models]
        with torch.device("meta"):
            model = getattr(torchvision.models, name)(weights=None, **kwargs)
        return model, _images(batch, 299 if name == "inception_v3" else 224)
    return build


def unet(batch: int):
    with torch.device("meta"):
        model = UNet()
    return model, _images(batch, (460, 608))


def bilstm(batch: int):
    with torch.device("meta"):
        model = BiLSTM()
    return model, (torch.empty(batch, 128, 100, device="meta"),)


def _ids(batch: int, seq: int):
    return (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)


def bert_large(batch: int):
    import transformers  # the optional extra coop-arena[models]
    config = transformers.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                     intermediate_size=4096)
    with torch.device("meta"):
        model = LanguageModelLoss(transformers.BertForMaskedLM(config))
    return model, _ids(batch, 512)


def gpt2(batch: int):
    import transformers
    config = transformers.GPT2Config()  # GPT-2 small, 124M parameters, context 1024
    with torch.device("meta"):
        model = LanguageModelLoss(transformers.GPT2LMHeadModel(config))
    return model, _ids(batch, 512)


@dataclass(frozen=True)
class Workload:
    build: Callable[[int], tuple]  # batch -> (model, inputs), on meta
    batch: int                     # the paper's batch size
    kind: str                      # "cnn", "transformer" or "rnn" (the targets differ)
    needs: str | None              # the optional library it needs, if any


SUITE: dict[str, Workload] = {
    "resnet50": Workload(_torchvision("resnet50"), 115, "cnn", "torchvision"),
    "resnet152": Workload(_torchvision("resnet152"), 55, "cnn", "torchvision"),
    "inception_v3": Workload(_torchvision("inception_v3", aux_logits=False, init_weights=False), 96, "cnn",
                             "torchvision"),
    "densenet121": Workload(_torchvision("densenet121"), 70, "cnn", "torchvision"),
    "unet": Workload(unet, 5, "cnn", None),
    "swin_t": Workload(_torchvision("swin_t"), 40, "transformer", "torchvision"),
    "bert_large": Workload(bert_large, 4, "transformer", "transformers"),
    "bilstm": Workload(bilstm, 2048, "rnn", None),
    "gpt2": Workload(gpt2, 8, "transformer", "transformers"),
}


def default_batch(name: str, batch: int | None = None) -> int:
    """`batch` if given, else the paper's batch size for a suite model, else 8."""
    return batch or (SUITE[name].batch if name in SUITE else 8)


def available(name: str) -> str | None:
    """None when the workload can be built here, else why not."""
    needs = SUITE[name].needs
    if needs is None:
        return None
    try:
        __import__(needs)
    except Exception as e:  # an import that fails for any reason (missing, or built for another torch)
        return f"{name} needs {needs} (pip install 'coop-arena[models]'): {type(e).__name__}: {e}"
    return None
