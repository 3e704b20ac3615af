"""The `coop-arena` command (also `python -m coop_arena`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="coop-arena", description="Train PyTorch models under a hard memory budget.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model under half its peak with each policy and compare")
    demo.add_argument("--steps", type=int, default=4, help="training steps per run (default: 4)")
    demo.add_argument("--ratio", type=float, default=0.5, help="budget as a fraction of the plain peak (default: 0.5)")
    plan = sub.add_parser("plan", help="dry run on meta: does a training step fit a budget, at what overhead")
    plan.add_argument("model", help="a suite model (resnet50, unet, gpt2, ...), an example (mlp, cnn, gpt, lstm) or "
                                    "module:function, where function(batch) returns (model, example_inputs)")
    plan.add_argument("--batch", type=int, default=None, help="default: the paper's batch size for a suite model, "
                                                                "8 otherwise")
    plan.add_argument("--budget", default="0.5", help="bytes with a unit (8GiB, 512MiB) or a ratio of the plain peak "
                                                      "in (0, 1] (default: 0.5)")
    plan.add_argument("--snapshot", metavar="FILE.pickle", default=None,
                      help="write the memory snapshot of coop's dry run, in the format of "
                           "torch.cuda.memory._snapshot() (open it at https://pytorch.org/memory_viz)")
    plan.add_argument("--plot", metavar="FILE.png", default=None,
                      help="draw the arena's occupancy over coop's dry run, evictions and recomputations marked "
                           "(.png, .svg or .pdf)")
    ev = sub.add_parser("evaluate", help="sweep memory ratios for the model suite, every policy and ablation; "
                                         "write results.json, summary.md and figures")
    ev.add_argument("--models", nargs="+", default=None,
                    help="models to sweep (default: the nine-model suite, or resnet50 and unet with --quick)")
    ev.add_argument("--quick", action="store_true", help="coarse ratios (steps of 0.1, no refinement)")
    ev.add_argument("--batch", type=int, default=None, help="override the batch size of every model")
    ev.add_argument("--configs", nargs="+", default=None, help="policy configurations (default: all)")
    ev.add_argument("--out", default="evaluation", help="folder for results.json, summary.md and the figures")
    ev.add_argument("--jobs", type=int, default=1, help="worker processes, one model each at a time")
    args = parser.parse_args(argv)
    if "" not in sys.path and os.getcwd() not in sys.path:  # the installed script: module:function models import
        sys.path.insert(0, os.getcwd())                     # from the current directory, as under `python -m`
    if args.command == "evaluate":
        from .evaluate import CONFIGS, QUICK, QUICK_MODELS, SUITE, Sweep, evaluate
        if args.batch is not None and args.batch <= 0:
            parser.error(f"--batch must be positive, got {args.batch}")
        if args.jobs < 1:
            parser.error(f"--jobs must be positive, got {args.jobs}")
        try:
            base = QUICK if args.quick else Sweep()
            sweep = Sweep(base.step, base.refine, tuple(args.configs or CONFIGS))
        except ValueError as e:
            parser.error(str(e))
        models = args.models or (list(QUICK_MODELS) if args.quick else list(SUITE))
        from .plan import check_models
        try:
            check_models(models)
        except ValueError as e:
            parser.error(str(e))
        out = Path(args.out)
        try:  # before the sweep, not after it: a folder that cannot be written is known at once
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            parser.error(f"--out {args.out!r}: cannot make that folder ({e.strerror or e}); give a folder that can be "
                         f"written")
        command = "coop-arena " + " ".join(sys.argv[1:] if argv is None else argv)
        from .evaluate import ran
        results = evaluate(models, sweep, batch=args.batch, out=out, command=command, jobs=args.jobs)
        if not ran(results):
            print(f"coop-arena: error: no model could be swept ({', '.join(results['models'])}); the reasons are in "
                  f"the table above and in {out / 'summary.md'}", file=sys.stderr)
            return 1
        return 0
    if args.command == "plan":
        from .plan import plan as run_plan
        if args.batch is not None and args.batch <= 0:
            parser.error(f"--batch must be positive, got {args.batch}")
        try:
            run_plan(args.model, args.batch, args.budget, snapshot=args.snapshot, plot=args.plot)
        except ValueError as e:
            parser.error(str(e))
        return 0
    if args.command == "demo":
        if args.steps < 1:
            parser.error(f"--steps must be positive, got {args.steps}")
        if not 0 < args.ratio <= 1:
            parser.error(f"--ratio must be in (0, 1], got {args.ratio}")
        from .demo import main as demo_main
        return demo_main(steps=args.steps, ratio=args.ratio)
    return 2


if __name__ == "__main__":
    sys.exit(main())
