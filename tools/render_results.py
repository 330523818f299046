"""Render the README's model table and docs/results.md's tables from results/*.csv (capsnet.results_tables).

python tools/render_results.py           # rewrite the marked tables in place
python tools/render_results.py --check   # exit 1, naming the file, if a table differs from the data
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from capsnet.experiments.zoo import ZooPlan
from capsnet.models.hub import NOT_SHIPPED, shipped_tags
from capsnet.models.registry import MODELS
from capsnet.results_tables import fill, load, render_all

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("README.md", "docs/results.md")


def _plan(benchmark: str, model: str) -> tuple[int, str]:
    """A model's epoch budget on `benchmark` and the command that makes its row (3 seeds, bf16 on a CPU)."""
    plan = ZooPlan(benchmark, [model], [0, 1, 2], out=Path("runs"), precision="bf16", device="cpu")
    return plan.epochs(model), plan.command(model)


def rendered(root: Path = ROOT) -> dict[Path, tuple[str, str]]:
    """Each target file: (its text, its text with the tables made from root/results)."""
    tables = render_all(
        load(root / "results"), list(MODELS), shipped_tags, lambda name: MODELS[name].paper, _plan, NOT_SHIPPED
    )
    out = {}
    for name in TARGETS:
        path = root / name
        text = path.read_text(encoding="utf-8")
        out[path] = (text, fill(text, tables, source=name))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only check that the files agree with the data")
    args = p.parse_args()
    stale = []
    for path, (text, new) in rendered().items():
        if text != new:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(
            f"render_results: {', '.join(map(str, stale))} disagree with results/: run python tools/render_results.py",
            file=sys.stderr,
        )
        return 1
    print("rewrote " + ", ".join(map(str, stale)) if stale else "the tables agree with results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
