"""``python -m scripts.bench``: run the benchmark suites and write the report.

    python -m scripts.bench                                   # quick settings, every suite
    python -m scripts.bench --suite throughput,ddp --rounds 3
    python -m scripts.bench --full                            # whole epochs, 10-epoch accuracy, 3 rounds
    python -m scripts.bench --suite compile --epochs 4        # torch.compile: cost, gain per step, break-even
    python -m scripts.bench --suite throughput --accelerator gpu --precision bf16-mixed   # on a CUDA GPU
    python -m scripts.bench --suite throughput --workload resnet18 --accelerator gpu --precision bf16-mixed

``--accelerator``/``--precision`` go to every contender of the throughput, start-up and accuracy
suites (the project as ``trainer.accelerator=...``/``trainer.precision=...``); the DDP suite stays on
CPU ranks (gloo), the pipeline and collectives suites run their own settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path

from scripts.bench import report, suites
from scripts.bench.contenders import ACCELERATORS, PRECISIONS, ROOT, WORKLOADS
from scripts.bench.context import Bench, Settings, SuiteResult, cpu_count

QUICK = dict(rounds=2, epochs=3, limit_train_batches=150, accuracy_epochs=3)
FULL = dict(rounds=3, epochs=4, limit_train_batches=0, accuracy_epochs=10)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--suite", default=",".join(suites.DEFAULT),
                        help=f"comma-separated subset of {','.join(suites.NAMES)} (default: all but compile)")
    parser.add_argument("--full", action="store_true", help=f"fuller settings: {FULL}")
    parser.add_argument("--rounds", type=int, help="runs of each contender, alternating")
    parser.add_argument("--epochs", type=int, help="epochs of throughput/DDP runs (the first is warm-up)")
    parser.add_argument("--limit-train-batches", type=int, help="steps per epoch of throughput/DDP runs (0 = all)")
    parser.add_argument("--accuracy-epochs", type=int)
    parser.add_argument("--threads", type=int, default=cpu_count(), help="torch threads per single process")
    parser.add_argument("--workers", default="0,2", help="DataLoader workers tried for the per-sample pipeline ('': skip it)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="global batch of the throughput and DDP runs (default: the config's, 128)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the DDP and collectives comparisons")
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="cpu",
                        help="where the throughput, start-up and accuracy contenders train (gpu: CUDA device 0)")
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true",
                        help="their precision (bf16-mixed: forward and loss under bf16 autocast)")
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="mlp",
                        help="throughput suite: mlp (Fashion-MNIST, batch 128) or resnet18 (synthetic CIFAR-10 files, "
                             "batch 256: speed only; the plain loop against the project, no per-sample or bare runs)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDE[,OVERRIDE...]",
                        help="throughput suite: also run the project with these Hydra overrides, as contender "
                             "'project NAME', e.g. --variant pinned=data.on_device=false (repeatable)")
    parser.add_argument("--no-paired", action="store_true",
                        help="skip the throughput suite's paired-step runs (2 of its 5 runs per round)")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the throughput suite's profiled runs on a GPU (one extra run per contender)")
    parser.add_argument("--no-tty", action="store_true", help="pipe the contenders' output instead of a terminal")
    parser.add_argument("--quiet-wait", type=float, default=20.0,
                        help="before each run wait up to this many seconds for other processes to go idle (0: never)")
    parser.add_argument("--out", default=None, help="results directory (default bench_results/<timestamp>)")
    args = parser.parse_args(argv)

    chosen = [s.strip() for s in args.suite.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(suites.NAMES))
    if unknown:
        parser.error(f"unknown suite(s) {', '.join(unknown)}; choose from {','.join(suites.NAMES)}")
    base = FULL if args.full else QUICK
    pick = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    if pick["epochs"] < 2:
        parser.error("--epochs must be >= 2: the first epoch is warm-up and not measured")
    if min(pick["rounds"], pick["accuracy_epochs"], args.threads, args.nproc, args.batch_size or 1) < 1:
        parser.error("--rounds, --accuracy-epochs, --threads, --nproc and --batch-size must be >= 1")
    if args.batch_size and args.batch_size % args.nproc:
        parser.error(f"--batch-size {args.batch_size} must divide evenly across --nproc {args.nproc} ranks")
    workers = tuple(int(w) for w in args.workers.split(",") if w.strip())
    variants = []
    for text in args.variant:
        name, _, overrides = text.partition("=")
        if not name or not overrides:
            parser.error(f"--variant {text!r}: write NAME=OVERRIDE[,OVERRIDE...], e.g. pinned=data.on_device=false")
        variants.append((name, tuple(overrides.split(","))))
    args.suite = chosen
    return args, Settings(**pick, threads=args.threads, workers=workers, nproc=args.nproc, tty=not args.no_tty,
                          full=args.full, quiet_wait=args.quiet_wait, batch_size=args.batch_size,
                          accelerator=args.accelerator, precision=args.precision, paired=not args.no_paired,
                          profile=not args.no_profile,
                          workload=args.workload, variants=tuple(variants))


def header(argv: list[str], settings: Settings) -> dict:
    import lightning
    import torch

    host = f"{platform.machine()}, {cpu_count()} cores, {_cpu_model()}, {_mem_gib():.0f} GiB"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "date": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{host}, no GPU" if not gpus else f"{host}, {gpus} x {torch.cuda.get_device_name(0)}",
        "python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
        "cuda": torch.version.cuda if gpus else None,
        "accelerator": settings.accelerator, "precision": settings.precision, "device": settings.device,
        "command": "python -m scripts.bench " + " ".join(argv), "load_before": _load(),
    }


def device_name(accelerator: str) -> str:
    """The name of the device the contenders train on: the GPU's, or the CPU model."""
    if accelerator == "gpu":
        import torch

        return torch.cuda.get_device_name(0)
    return _cpu_model()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, settings = parse(argv)
    from scripts.bench.plain_loop import require_device

    reason = require_device(args.accelerator, args.precision)
    if reason:  # before anything is written or run
        print(f"error: {reason}", file=sys.stderr)
        return 2
    settings = dataclasses.replace(settings, device=device_name(args.accelerator))
    out = Path(args.out) if args.out else ROOT / "bench_results" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    from scripts.bench.data_pipeline import ensure_data

    ensure_data(args.workload)
    info = header(argv, settings)
    print(f"bench: {', '.join(args.suite)} -> {out}\n  settings: {settings}", flush=True)
    bench = Bench(out, settings)
    results: list[SuiteResult] = []
    start = time.perf_counter()
    for name in args.suite:
        print(f"[{name}]", flush=True)
        try:
            results.append(suites.load(name)(bench))
        except Exception as err:  # one broken suite must not lose the others' results
            traceback.print_exc()
            results.append(SuiteResult(name, name, notes=[f"suite failed: {type(err).__name__}: {err}"]))
    info.update(load_after=_load(), seconds=round(time.perf_counter() - start, 1))
    paths = report.write(out, results, info)
    print(paths["markdown"].read_text())
    print(f"wrote {paths['markdown']} and {paths['json']} in {info['seconds']:.0f} s")
    return 0


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _mem_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 0.0


if __name__ == "__main__":
    raise SystemExit(main())
