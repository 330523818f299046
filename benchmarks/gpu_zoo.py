"""Full Fashion-MNIST zoo rows on a lent GPU inside a time limit: one `capsnet reproduce zoo` process per (model,
seed), several at once on the GPU, then each model's row from the seeds that finished.

    python benchmarks/gpu_zoo.py --out OUT --minutes M [--models a,b] [--seeds 3] [--parallel 6] [--dataset DIR]
                                 [--work DIR]
    python benchmarks/gpu_zoo.py --merge OUT/fashion-mnist.csv    (back on the project's machine: into results/)

Without --models, every registered model whose row in results/fashion-mnist.csv has fewer than --seeds seeds, the
slowest on this project's CPU first (results/cost.csv): those are the rows a CPU cannot make (but not em-capsnet,
whose seed takes longer than a session on a GPU too: SLOW_ON_A_GPU). The models without a row come first, all their
seeds (seed 0 of each, then the seeds 1, then the seeds 2), and then the models whose row has too few seeds (trained
from seed 0 again: a row is one machine's seeds). A process still running when the training time is up is stopped, and
its run is lost with the machine. Each model then gets the row of its finished seeds 0..k-1 (`capsnet reproduce zoo
--seeds k`, which trains nothing for a finished run) in OUT/fashion-mnist.csv; a row of fewer seeds than asked for
says so in its note. OUT/logs.tgz holds every process's output; the runs stay in --work (OUT/work). The rows record
the GPU, and the batch each model trains at on CUDA (128 where its recipe sets none; 16 on a CPU).
benchmarks/gpu_session.sh runs this after the GPU check.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path

from capsnet.experiments.zoo import FASHION_EPOCHS, ZooPlan, seed_hours
from capsnet.models.registry import MODELS
from capsnet.results import read_rows, write_rows

ROWS_SECONDS = 60.0  # kept back from --minutes for the rows: each model's row process (its affine pass if missing)
STOP_SECONDS = 20.0  # a stopped process's grace before it is killed
Job = tuple[str, int]  # (model, seed); seed -1: the model's row
# Left out unless --models names them: a seed would not finish in a session's minutes (measured on an H200)
SLOW_ON_A_GPU = {"em-capsnet": "162-338 img/s on the shapes set at batch 128 beside five other trainings"}


def job_name(job: Job) -> str:
    return f"{job[0]}-row" if job[1] < 0 else f"{job[0]}-seed-{job[1]}"


def rows_held(results: Path) -> dict[str, int]:
    """How many seeds each model's row in results/fashion-mnist.csv has (a model without a row: absent)."""
    path = results / "fashion-mnist.csv"
    rows = read_rows(path) if path.is_file() else []
    return {r.model: len(r.seeds.split()) for r in rows if r.test_acc_mean is not None}


def wanted_models(results: Path, seeds: int, precision: str) -> list[str]:
    """The registered models whose Fashion-MNIST row has fewer than `seeds` seeds (but not those SLOW_ON_A_GPU):
    those without a row first, then those with too few seeds; within each, the slowest on the CPU first."""
    have = rows_held(results)
    models = [m for m in MODELS if have.get(m, 0) < seeds and m not in SLOW_ON_A_GPU]
    hours = {m: (seed_hours(results, m, precision, FASHION_EPOCHS) or (0.0, ""))[0] for m in models}
    return sorted(models, key=lambda m: (m in have, -hours[m]))


def jobs_in_order(models: Sequence[str], seeds: int, *, first: Collection[str] = ()) -> list[Job]:
    """Every seed of the models in `first`, then every seed of the others; within each group seed 0 of every model,
    then seed 1 of every model, and so on."""
    groups = [[m for m in models if m in first], [m for m in models if m not in first]]
    return [(m, s) for group in groups for s in range(seeds) for m in group]


def run_jobs(
    jobs: Sequence[Job], command: Callable[[Job], list[str]], *, parallel: int, until: float, logs: Path
) -> list[Job]:
    """Run each job's command, `parallel` at once, starting none after `until` (time.monotonic()) and stopping
    those still running then (SIGTERM, then SIGKILL after STOP_SECONDS). Returns the jobs whose command exited 0."""
    pending, done = list(jobs), []
    running: dict[Job, subprocess.Popen] = {}
    while pending or running:
        for job, proc in list(running.items()):
            if proc.poll() is not None:
                del running[job]
                if proc.returncode == 0:
                    done.append(job)
        if time.monotonic() >= until:
            break
        while pending and len(running) < parallel:
            job = pending.pop(0)
            with open(logs / f"{job_name(job)}.log", "w") as log:
                running[job] = subprocess.Popen(command(job), stdout=log, stderr=subprocess.STDOUT)
        time.sleep(0.2)
    for proc in running.values():
        proc.terminate()
    for job, proc in running.items():
        try:
            proc.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"stopped at the time limit: {job_name(job)}", flush=True)
    return done


def finished_prefix(model: str, finished: Callable[[str, int], bool], seeds: int) -> int:
    """How many of the seeds 0, 1, ... of `model` finished before the first one that did not."""
    k = 0
    while k < seeds and finished(model, k):
        k += 1
    return k


def zoo_command(model: str, *, first: int, seeds: int, args: argparse.Namespace, results: Path) -> list[str]:
    command = [sys.executable, "-m", "capsnet", "reproduce", "zoo", "--benchmark", "fashion-mnist", "--model", model]
    command += ["--seed", str(first), "--seeds", str(seeds), "--precision", args.precision, "--device", args.device]
    command += ["--out", str(args.work), "--results", str(results)]
    return command + (["--dataset", args.dataset] if args.dataset else [])


def note_short_rows(path: Path, asked: int) -> None:
    """Each row of fewer seeds than `asked` says so in its note."""
    rows = [r for r in read_rows(path) if len(r.seeds.split()) < asked]
    for r in rows:
        said = f"seeds {r.seeds} of the {asked} planned: the GPU session's time ended"
        write_rows(path, [replace(r, note="; ".join(x for x in (r.note, said) if x))])


def merge(new: Path, path: Path) -> None:
    """The rows of `new` into `path`, each where `path` holds no row of more seeds for its model."""
    have = rows_held(path.parent)
    rows = read_rows(new)
    kept = [r for r in rows if len(r.seeds.split()) >= have.get(r.model, 0)]
    write_rows(path, kept)
    print(f"merged {len(kept)} rows into {path}: {', '.join(r.model for r in kept) or 'none'}")
    for r in rows:
        if r not in kept:
            print(f"kept {path}'s row of {r.model}: {have[r.model]} seeds, against {len(r.seeds.split())} here")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="OUT: fashion-mnist.csv and logs.tgz")
    parser.add_argument("--work", type=Path, help="the runs and their logs (default: OUT/work)")
    parser.add_argument("--minutes", type=float, default=4.0, help="the whole run, rows included")
    parser.add_argument("--models", help="comma list (default: the rows results/ lacks, slowest first)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=6, help="processes at once on the GPU")
    parser.add_argument("--dataset", help="the folder of Fashion-MNIST's four IDX files")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--results", type=Path, default=Path("results"), help="what results/ holds already")
    parser.add_argument("--merge", type=Path, help="merge this fashion-mnist.csv into --results, and stop")
    args = parser.parse_args(argv)
    if args.merge is not None and not args.merge.is_file():
        parser.error(f"--merge: no such file: {args.merge}")
    if args.merge is None and args.out is None:
        parser.error("--out is needed (or --merge)")
    if args.dataset and not Path(args.dataset).is_dir():
        parser.error(f"--dataset: no such folder: {args.dataset}")
    for name in ("minutes", "seeds", "parallel"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.models:
        unknown = [m for m in args.models.split(",") if m not in MODELS]
        if unknown:
            parser.error(f"--models: unknown model {unknown[0]!r}; known: {', '.join(MODELS)}")
        args.models = [MODELS.canonical(m) for m in args.models.split(",")]
    return args


def train_seeds(args: argparse.Namespace, models: list[str], until: float, *, first: Collection[str]) -> ZooPlan:
    """Every (model, seed) until `until`; the plan that says where each seed's run is."""
    scratch = args.work / "rows"  # each process's own one-seed row, not kept

    def seed_command(job: Job) -> list[str]:
        return zoo_command(job[0], first=job[1], seeds=1, args=args, results=scratch / f"{job[0]}-{job[1]}")

    jobs = jobs_in_order(models, args.seeds, first=first)
    run_jobs(jobs, seed_command, parallel=args.parallel, until=until, logs=args.logs)
    return ZooPlan(
        benchmark="fashion-mnist",
        models=list(MODELS),
        seeds=[0],
        out=args.work,
        precision=args.precision,
        device=args.device,
    )


def make_rows(args: argparse.Namespace, models: list[str], finished: Callable[[str, int], bool], until: float) -> None:
    """Each model's row of its finished seeds 0..k-1, in OUT/fashion-mnist.csv, all models at once."""
    rows = {}
    for model in models:
        k = finished_prefix(model, finished, args.seeds)
        if k:
            rows[model] = zoo_command(model, first=0, seeds=k, args=args, results=args.out)
    jobs = [(m, -1) for m in rows]
    run_jobs(jobs, lambda job: rows[job[0]], parallel=max(len(jobs), 1), until=until, logs=args.logs)
    path = args.out / "fashion-mnist.csv"
    if path.is_file():
        note_short_rows(path, args.seeds)
        for r in read_rows(path):
            print(f"{r.model}: {r.test_acc_mean:.2f} ± {r.test_acc_std:.2f}% (seeds {r.seeds}), batch {r.batch_size}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge is not None:
        merge(args.merge, args.results / "fashion-mnist.csv")
        return 0
    start = time.monotonic()
    models = args.models or wanted_models(args.results, args.seeds, args.precision)
    args.work = args.work or args.out / "work"
    args.logs = args.work / "logs"
    args.logs.mkdir(parents=True, exist_ok=True)
    print(f"gpu_zoo: {', '.join(models) or 'nothing to do'}; {args.seeds} seeds; {args.minutes} min", flush=True)
    rowless = [] if args.models else [m for m in models if m not in rows_held(args.results)]
    plan = train_seeds(args, models, until=start + 60 * args.minutes - ROWS_SECONDS, first=rowless)

    def finished(model: str, seed: int) -> bool:  # trained and tested (a stopped affine pass: the row process's)
        return (plan.run_dir(model, seed) / "test.json").is_file()

    make_rows(args, models, finished, until=start + 60 * args.minutes - STOP_SECONDS)
    with tarfile.open(args.out / "logs.tgz", "w:gz") as tar:
        tar.add(args.logs, arcname="logs")
    trained = sum(finished(m, s) for m, s in jobs_in_order(models, args.seeds))
    print(f"gpu_zoo: {trained} of {len(models) * args.seeds} seeds trained in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
