"""Start-up times of capsnet against `python -c "import torch"`, measured in the same run, as ratios.

Each command runs `--repeats` times in a fresh interpreter (the first run of each is discarded: it warms the file
cache); the median wall time is reported, and each ratio is against the median of `import torch`. The targets:
`import capsnet` (and its whole public API) ≤ 1.15× torch, `capsnet --help` and `capsnet train --help` ≤ 1.0 s,
`capsnet models` ≤ 1.3× torch.

    python benchmarks/bench_startup.py [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PY = sys.executable
CASES: list[tuple[str, list[str], str]] = [
    ("import torch", [PY, "-c", "import torch"], "reference"),
    ("import capsnet", [PY, "-c", "import capsnet"], "<= 1.15x torch"),
    (
        "capsnet's public API",
        [PY, "-c", "import capsnet\nfor n in capsnet.__all__: getattr(capsnet, n)"],
        "<= 1.15x torch",
    ),
    ("capsnet --help", [PY, "-m", "capsnet", "--help"], "<= 1.0 s"),
    ("capsnet train --help", [PY, "-m", "capsnet", "train", "--help"], "<= 1.0 s"),
    ("capsnet models", [PY, "-m", "capsnet", "models"], "<= 1.3x torch"),
]


def wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def measure(repeats: int) -> list[dict]:
    times: dict[str, list[float]] = {name: [] for name, _, _ in CASES}
    for _name, argv, _ in CASES:
        wall(argv)  # warm-up
    for _ in range(repeats):  # interleaved, so that a busy moment of the machine touches every case alike
        for name, argv, _ in CASES:
            times[name].append(wall(argv))
    torch_s = statistics.median(times["import torch"])
    rows = []
    for name, _, target in CASES:
        median = statistics.median(times[name])
        ratio = median / torch_s
        if target.endswith(" s"):
            ok = median <= float(target.split()[1])
        elif target == "reference":
            ok = True
        else:
            ok = ratio <= float(target.split()[1].rstrip("x"))
        rows.append({"case": name, "median_s": round(median, 3), "ratio": round(ratio, 2), "target": target, "ok": ok})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = measure(args.repeats)
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{'case':<22} {'median s':>9} {'× torch':>8}  target")
        for r in rows:
            missed = "" if r["ok"] else "  MISSED"
            print(f"{r['case']:<22} {r['median_s']:>9.3f} {r['ratio']:>8.2f}  {r['target']}{missed}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
