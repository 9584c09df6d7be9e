"""The watchdog's load at scale (the figures in docs/faults.md), on the harness of tests/test_watchdog_load.py.

    python -m scripts.studies.watchdog_load --ranks 64 128 256
    python -m scripts.studies.watchdog_load --ranks 32 --timeout 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tests.helpers.watchdog_load import measure


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--ranks-per-host", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=10.0, help="the watchdog's timeout_s (hang_timeout_s)")
    parser.add_argument("--window", type=float, default=10.0, help="seconds the store's load is measured over")
    parser.add_argument("--faults", nargs="+", choices=["kill", "stop", "none"], default=["kill", "stop"],
                        help="none: the load only")
    parser.add_argument("--module", default="src.engine.runtime.watchdog", help="the module holding RankWatchdog")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = []
    for n in args.ranks:
        for fault in args.faults:
            result = measure(n, fault, args.ranks_per_host, args.timeout, window_s=args.window, module_name=args.module)
            results.append(result)
            print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": f"{os.cpu_count()} CPUs, {sys.platform}", "results": results},
                                        indent=1))


if __name__ == "__main__":
    main()
