"""Model zoo smoke layer: models of `timm` and `transformers`, built from configs (no downloads, tiny inputs), trained
a few steps under Budgets, bitwise against plain PyTorch.

    python -m bench.zoo --out bench/results/zoo.md        # make zoo (the evaluation environment: timm needs
                                                          # torchvision)
    python -m bench.zoo --models gpt2,bert                # some of them

Each model trains STEPS steps (SGD with momentum, fixed data, dropout on) from the same weights: once plainly,
then under `Budget(r * P, headroom=0)` for r in 1.0, 0.5, 0.3 with coop and 0.5 with dtr, where P is the arena
peak of the same steps under an ample Budget (the arena's own count, so that the ratios are the policy's). A run
is `exact` when every parameter, buffer and the last loss equal plain PyTorch's bit for bit; `does not fit` when
the Budget raises OutOfBudget (the step needs more at once than r * P: see the lower bound, the ample run's
`stats.lower_bound`); anything else is a defect.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import coop_arena
from coop_arena import OutOfBudget

from .opinfo import same

STEPS = 2
RUNS = (("coop", 1.0), ("coop", 0.5), ("coop", 0.3), ("dtr", 0.5))


def _hf(kind, **cfg):
    def make():
        import transformers
        config = transformers.AutoConfig.for_model(kind, **cfg)
        auto = transformers.AutoModelForSeq2SeqLM if kind in ("t5", "bart") else transformers.AutoModelForCausalLM
        if kind in ("bert", "roberta", "distilbert"):
            auto = transformers.AutoModelForMaskedLM
        model = auto.from_config(config, attn_implementation="eager")
        vocab = config.vocab_size
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (2, 16), generator=g)
        batch = {"input_ids": ids, "labels": torch.randint(0, vocab, (2, 16), generator=g)}
        return model, batch, lambda out: out.loss
    return make


def _timm(name, **kw):
    def make():
        import timm
        model = timm.create_model(name, pretrained=False, num_classes=10, **kw)
        g = torch.Generator().manual_seed(1)
        size = kw.get("img_size", 64)
        x, y = torch.randn(2, 3, size, size, generator=g), torch.randint(0, 10, (2,), generator=g)
        return model, {"x": x, "y": y}, None
    return make


SMALL = dict(vocab_size=128)
MODELS = {
    "gpt2": _hf("gpt2", n_layer=2, n_embd=64, n_head=2, n_positions=64, **SMALL),
    "bert": _hf("bert", num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
                max_position_embeddings=64, **SMALL),
    "roberta": _hf("roberta", num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
                   max_position_embeddings=80, **SMALL),
    "t5": _hf("t5", num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=2, d_kv=32,
              decoder_start_token_id=0, pad_token_id=0, **SMALL),
    "bart": _hf("bart", encoder_layers=2, decoder_layers=2, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128,
                encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=64, **SMALL),
    "llama": _hf("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, **SMALL),
    "mistral": _hf("mistral", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, **SMALL),
    "opt": _hf("opt", num_hidden_layers=2, hidden_size=64, ffn_dim=128, num_attention_heads=2,
               max_position_embeddings=64, word_embed_proj_dim=64, **SMALL),
    "resnet18": _timm("resnet18"),
    "efficientnet_b0": _timm("efficientnet_b0"),
    "mobilenetv3_small_100": _timm("mobilenetv3_small_100"),
    "convnext_atto": _timm("convnext_atto"),
    "regnetx_002": _timm("regnetx_002"),
    "vit_tiny_patch16_224": _timm("vit_tiny_patch16_224", img_size=32),
    "deit_tiny_patch16_224": _timm("deit_tiny_patch16_224", img_size=32),
    "swin_tiny_patch4_window7_224": _timm("swin_tiny_patch4_window7_224", img_size=56, window_size=7),
}
# The models `make test` runs (tests/test_zoo.py): transformers is in the test environment, timm is not.
TEST_MODELS = ("gpt2", "bert", "t5", "llama")


def _train(name, budget):
    torch.manual_seed(0)
    model, batch, loss_of = MODELS[name]()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss = None
    for _ in range(STEPS):
        torch.manual_seed(1)
        with budget if budget is not None else torch.enable_grad():
            if loss_of is not None:
                loss = loss_of(model(**batch))
            else:
                loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
            loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()] + [b.clone() for b in model.buffers()] + [loss.detach()]


def run_model(name, runs=RUNS) -> list[dict]:
    """One row per run: policy, ratio, outcome, evictions, recomputations."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = _train(name, None)
        probe = coop_arena.Budget(1 << 30, device="cpu", headroom=0)
        rows = [{"policy": "coop", "ratio": "ample", "outcome": "exact" if same(_train(name, probe), plain)
                 else "mismatch", "evictions": 0, "rematerializations": 0}]
        peak = probe.stats.peak_bytes
        for policy, ratio in runs:
            budget = coop_arena.Budget(max(int(ratio * peak), 4096), device="cpu", headroom=0, policy=policy)
            try:
                outcome = "exact" if same(_train(name, budget), plain) else "mismatch"
            except OutOfBudget:
                outcome = "does not fit"
            except Exception as e:  # a defect: reported, not raised, so that the table is complete
                outcome = f"error: {type(e).__name__}: {str(e)[:160]}"
            st = budget.stats
            rows.append({"policy": policy, "ratio": ratio, "outcome": outcome, "evictions": st.evictions,
                         "rematerializations": st.rematerializations, "peak": peak,
                         "lower_bound": probe.stats.lower_bound})
        return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    names = a.models.split(",") if a.models else list(MODELS)
    start = time.perf_counter()
    lines = ["# Model zoo under a Budget", "",
             f"`python -m bench.zoo" + (f" --models {a.models}" if a.models else "") + f"` (CPU, torch "
             f"{torch.__version__}; {STEPS} steps per run). Each cell: outcome (evictions / recomputations). P is "
             f"the arena peak of the steps under an ample Budget.", "",
             "| model | P | lower bound / P | ample | coop 1.0 | coop 0.5 | coop 0.3 | dtr 0.5 |",
             "|---|---:|---:|---|---|---|---|---|"]
    bad = 0
    for name in names:
        try:
            rows = run_model(name)
        except Exception as e:  # the model itself could not be built or run plainly
            lines.append(f"| {name} | | | not run: {type(e).__name__}: {str(e)[:120]} | | | | |")
            continue
        bad += sum(r["outcome"] not in ("exact", "does not fit") for r in rows)
        cells = [r["outcome"] + (f" ({r['evictions']} / {r['rematerializations']})" if r["evictions"] else "")
                 for r in rows]
        lines.append(f"| {name} | {rows[1]['peak'] / 2**20:.2f} MiB | {rows[1]['lower_bound'] / rows[1]['peak']:.2f} | "
                     + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += ["", f"{time.perf_counter() - start:.0f} s."]
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
