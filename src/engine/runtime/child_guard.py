"""The last resort when a child rank fails: end the ranks left, after the watchdog has had time to say why.

Lightning's popen launcher watches the child ranks it starts and, within 5 s of one exiting non-zero, SIGKILLs
every rank, its own process included, with no word of which rank failed or why. The project's watchdog
(:mod:`src.engine.runtime.watchdog`) sees a dead rank within about a second and ends the job with one line naming
it. Both race: on a loaded machine Lightning's guard won, and the job ended without its line. So the project
starts its ranks without Lightning's guard and runs this one, which waits ``grace_s`` after the first
failure before it ends what is left: a rank that died before the watchdog ran (at start-up), or one the
watchdog could not end. Lightning has no setting for that wait, hence this small thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

GRACE_S = 10.0  # the watchdog names a dead rank within about 1 s, a frozen one after hang_timeout_s
# A rank that stopped on a stop signal exits 128 + its number after the agreed checkpoint (src.engine.runtime.sigterm):
# not a failure. Rank 0 may then need longer than the grace to requeue the job (scontrol, submitit's pickle).
STOPPED = frozenset(128 + s for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2))


def guard_child_ranks(children: list[subprocess.Popen], grace_s: float = GRACE_S, poll_s: float = 0.5) -> None:
    """Watch ``children`` from a daemon thread: ``grace_s`` after one fails (exits non-zero, and not after a stop
    signal), SIGKILL the others and this process."""
    threading.Thread(target=_guard, args=(children, grace_s, poll_s), name="child-rank-guard", daemon=True).start()


def _guard(children: list[subprocess.Popen], grace_s: float, poll_s: float) -> None:
    failed_at = None
    while True:
        codes = [child.poll() for child in children]
        if all(code == 0 or code in STOPPED for code in codes):
            return
        if failed_at is None and any(code and code not in STOPPED for code in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at >= grace_s:
            for child in children:
                with contextlib.suppress(OSError):
                    child.send_signal(signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(poll_s)
