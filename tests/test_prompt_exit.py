"""The prompt exit keeps what the interpreter's exit guarantees: atexit handlers, flushed logs, the exit status."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.config import ROOT

pytestmark = pytest.mark.fast

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from src.engine.runtime import prompt_exit
prompt_exit.install()
import atexit, logging
log = logging.getLogger("job")
log.addHandler(logging.FileHandler({log!r}))  # buffered until flushed or closed
log.setLevel(logging.INFO)
atexit.register(lambda: open({marker!r}, "w").write("atexit ran"))
def main():
    log.info("written before the exit")
    print("last line", end="")  # no newline: only a flush sends it
    {ending}
with prompt_exit.exit_code_recorded():
    main()
"""


def run(tmp_path: Path, ending: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    log, marker = tmp_path / "job.log", tmp_path / "marker"
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT).format(root=str(ROOT), log=str(log), marker=str(marker), ending=ending))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60), log, marker


@pytest.mark.parametrize(("ending", "code"), [("pass", 0), ("sys.exit(2)", 2), ("raise ValueError('boom')", 1),
                                              ("sys.exit('fatal')", 1)])
def test_exit_status_handlers_and_flushes_survive(tmp_path, ending, code):
    proc, log, marker = run(tmp_path, ending)
    assert proc.returncode == code, proc.stderr
    assert marker.read_text() == "atexit ran"
    assert log.read_text().strip() == "written before the exit"
    assert proc.stdout == "last line"
    if code == 1 and "boom" in ending:
        assert "ValueError: boom" in proc.stderr  # the traceback is still printed


NOT_SPAWNED = """
import multiprocessing, sys
sys.path.insert(0, {root!r})
from src.engine.runtime import prompt_exit

def check(_=None):
    exit_ = sys.exit
    prompt_exit.end_spawned_process_promptly()
    assert sys.exit is exit_, "sys.exit wrapped in a process multiprocessing did not spawn"

if __name__ == "__main__":
    check()  # the launching process (under pytest, a direct SpawnedRank call)
    with multiprocessing.get_context("fork").Pool(1) as pool:  # a forked rank
        pool.map(check, [0])
    sys.exit(3)
"""


def test_a_process_that_was_not_spawned_keeps_its_exit(tmp_path):
    """Only a spawned rank's exit is taken over: elsewhere a caught ``sys.exit`` would set a later exit's status."""
    script = tmp_path / "script.py"
    script.write_text(NOT_SPAWNED.format(root=str(ROOT)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
