"""The helper that runs entry points for the tests: a run forked from its server is the run a fresh interpreter
makes (exit status, stdout, stderr), and a run past its timeout ends as ``subprocess.run`` ends it."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers.entry import run_entry


@pytest.mark.fast
def test_a_forked_run_prints_and_exits_as_a_fresh_interpreter_does(tmp_path, monkeypatch):
    args = ("trainer.devices=0", f"hydra.run.dir={tmp_path}/run")
    forked = run_entry("train", *args)
    monkeypatch.setenv("TESTS_FRESH_INTERPRETERS", "1")
    fresh = run_entry("train", *args)
    assert forked.returncode == 2 and forked.stderr.startswith("error: trainer.devices=0"), forked.stderr
    assert forked.stdout.startswith("CONFIG")  # the composed config, printed before the check
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


@pytest.mark.fast
def test_a_forked_run_past_its_timeout_is_killed_and_the_next_one_runs(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_entry("train", "trainer.max_epochs=100", f"hydra.run.dir={tmp_path}/long", timeout=1)
    proc = run_entry("train", "trainer.devices=0", f"hydra.run.dir={tmp_path}/next")
    assert proc.returncode == 2, proc.stderr
