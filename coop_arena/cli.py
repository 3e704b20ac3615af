"""The `coop-arena` command (also `python -m coop_arena`)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="coop-arena", description="Train PyTorch models under a hard memory budget.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model under half its peak with each policy and compare")
    demo.add_argument("--steps", type=int, default=4)
    demo.add_argument("--ratio", type=float, default=0.5, help="budget as a fraction of the plain peak")
    plan = sub.add_parser("plan", help="dry run on meta: does a training step fit a budget, at what overhead")
    plan.add_argument("model", help="a name from coop_arena.examples (mlp, cnn, gpt, lstm) or module:function, "
                                    "where function(batch) returns (model, example_inputs)")
    plan.add_argument("--batch", type=int, default=8)
    plan.add_argument("--budget", default="0.5", help="bytes with a unit (8GiB, 512MiB) or a ratio of the plain peak")
    args = parser.parse_args(argv)
    if args.command == "plan":
        from .plan import plan as run_plan
        if args.batch <= 0:
            parser.error(f"--batch must be positive, got {args.batch}")
        try:
            run_plan(args.model, args.batch, args.budget)
        except ValueError as e:
            parser.error(str(e))
        return 0
    if args.command == "demo":
        if not 0 < args.ratio <= 1:
            parser.error(f"--ratio must be in (0, 1], got {args.ratio}")
        from .demo import main as demo_main
        return demo_main(steps=args.steps, ratio=args.ratio)
    return 2


if __name__ == "__main__":
    sys.exit(main())
