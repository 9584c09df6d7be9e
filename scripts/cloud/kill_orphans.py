"""End this project's orphaned training ranks, by PID, on this machine.

    python scripts/cloud/kill_orphans.py [--pid-dir logs/.pids] [--grace 10] [--dry-run]

Every rank registers itself in ``<paths.log_dir>/.pids/<pid>.json`` while its job runs
(``src.engine.run.pid_file.PidFile``). A rank is an orphan when the launcher that started it (rank 0's
process, or torchrun) is gone: it would otherwise wait in a collective until the timeout, holding its GPU.
Orphans get SIGTERM, then SIGKILL after ``--grace`` seconds. Nothing else is touched: no name matching,
and a PID is only signalled if its start time matches the record.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from src.engine.run.pid_file import registered_ranks  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pid-dir", type=Path, default=Path("logs/.pids"), help="where the ranks registered")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--dry-run", action="store_true", help="only list what would be ended")
    args = parser.parse_args()

    ranks = registered_ranks(args.pid_dir)
    for record, proc, orphaned in ranks:
        state = "launcher alive, left alone" if not orphaned else "ORPHAN" + (" (dry run)" if args.dry_run else "")
        print(f"pid {proc.pid}: {state}; run dir {record['run_dir']}")
    orphans = [(record, proc) for record, proc, orphaned in ranks if orphaned]
    if not orphans or args.dry_run:
        print(f"{len(orphans)} orphaned rank(s) in {args.pid_dir}")
        return 0
    for _, proc in orphans:
        proc.terminate()
    _, alive = psutil.wait_procs([proc for _, proc in orphans], timeout=args.grace)
    for proc in alive:  # blocked in a collective, a SIGTERM alone may not stop it
        proc.kill()
    psutil.wait_procs(alive, timeout=5)
    for record, _ in orphans:
        Path(record["file"]).unlink(missing_ok=True)
    print(f"ended {len(orphans)} orphaned rank(s): {' '.join(str(proc.pid) for _, proc in orphans)}"
          + (f" ({len(alive)} needed SIGKILL)" if alive else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
