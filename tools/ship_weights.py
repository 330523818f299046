"""Ship a finished training run's validation-chosen checkpoint (RUN/best/) inside the package, with its card.

    python tools/ship_weights.py RUN [RUN ...] --tag TAG [--root DIR] [--half]
    python tools/ship_weights.py --halve MODEL:TAG [--root DIR]

Given several runs (the seeds of one setting), it ships the one whose best/ has the lowest validation loss.
`--halve` stores weights already shipped again as float16, under the same check as `--half`.

Writes src/capsnet/models/weights/<model>/<tag>/ (or DIR/<model>/<tag>/): see capsnet.tools.ship. Then run
tests/test_shipped.py, which scores the folder again and must find the card's figures.
"""

import argparse
import sys

from capsnet.errors import CapsNetError
from capsnet.models.hub import read_card
from capsnet.tools.ship import choose_run, halve_shipped, ship_run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "runs", metavar="RUN", nargs="*", help="finished training run folders (with test.json and best/)"
    )
    parser.add_argument("--tag", help="the tag to ship it as, e.g. fashion-mnist")
    parser.add_argument("--root", help="the weights root (default: the package's models/weights/)")
    parser.add_argument(
        "--half", action="store_true", help="store float16 weights (refused where that changes a prediction)"
    )
    parser.add_argument("--halve", metavar="MODEL:TAG", help="store shipped weights again as float16")
    args = parser.parse_args()
    if args.halve and (args.runs or args.tag or args.half):
        parser.error("--halve takes no RUN, --tag or --half")
    if not args.halve and not (args.runs and args.tag):
        parser.error("give RUN [RUN ...] and --tag, or --halve MODEL:TAG")
    try:
        if args.halve:
            name, _, tag = args.halve.partition(":")
            run, folder = None, halve_shipped(name, tag, root=args.root)
        else:
            run = choose_run(args.runs)
            folder = ship_run(run, tag=args.tag, root=args.root, half=args.half)
    except (CapsNetError, OSError) as e:
        print(f"ship_weights: error: {e}", file=sys.stderr)
        return 2
    card = read_card(folder) or {}
    print(
        f"{folder}" + (f" (from {run})" if run else "") + f": epoch {card.get('epoch')}, validation "
        f"{card.get('val_accuracy', 0):.4f}, test {card.get('test_accuracy', 0):.4f}, "
        f"{card.get('storage', {}).get('dtype', 'float32')}\n  {card.get('command')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
