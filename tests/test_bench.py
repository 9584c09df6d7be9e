"""The benchmark harness runs end to end, and the speed fixes keep the metrics exactly as they were."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch

from src.engine.steps.step_module import StepModule
from src.train import train
from tests.helpers.config import ROOT
from tests.helpers.docs import docs_command


def _log_every_step(self, name, metric, prog_bar=True):
    """What ``record_step`` did before ``log_epoch_metric``: ``self.log`` the metric on every step."""
    self.log(name, metric, on_step=False, on_epoch=True, prog_bar=prog_bar)


@pytest.mark.slow
def test_logging_metrics_once_per_epoch_gives_the_same_values(make_cfg, monkeypatch):
    overrides = ["trainer.max_epochs=2", "++trainer.limit_val_batches=3", "++trainer.limit_test_batches=3"]
    once, _ = train(make_cfg("train", overrides, subdir="once"))
    monkeypatch.setattr(StepModule, "log_epoch_metric", _log_every_step)
    every, _ = train(make_cfg("train", overrides, subdir="every"))
    keys = [k for k in every if k.split("/")[0] in ("train", "val", "test") and "best" not in k]
    assert {"train/loss", "train/acc", "val/loss", "val/acc", "test/loss", "test/acc"} <= set(keys)
    for key in keys:
        assert float(once[key]) == float(every[key]), key


def docs_bench_command() -> str:
    """The `python -m scripts.bench` command of docs/benchmarks.md, as written."""
    return docs_command("python -m scripts.bench --suite throughput,startup")


@pytest.mark.slow
def test_bench_writes_table_json_and_plots(tmp_path):
    """The docs' bench command, shortened to one round of minimal steps: the outputs exist and hold positive
    numbers (no timing asserted). It is this test that runs that docs command (tests/test_readme_commands.py)."""
    out = tmp_path / "bench"
    shorter = ["--rounds", "1", "--epochs", "2", "--limit-train-batches", "5", "--workers", "0", "--quiet-wait", "0",
               "--threads", "1", "--out", str(out)]  # the last value of an option wins; one thread: the suite runs
    # two test files at a time on the same cores
    cmd = [sys.executable, *shlex.split(docs_bench_command())[1:], *shorter]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    md = (out / "results.md").read_text()
    assert "| project |" in md and "| plain loop |" in md and "| per-sample, 0 workers |" in md
    assert "| bare Lightning |" in md
    data = json.loads((out / "results.json").read_text())
    suites = {s["name"]: s for s in data["suites"]}
    tput = suites["throughput"]["raw"]
    for name in ("project", "plain loop", "bare Lightning", "per-sample, 0 workers"):
        assert tput["samples_per_s"][name][0] > 0, name
        assert tput["peak_rss_mb"][name][0] > 0, name
    assert tput["bare_lightning_over_plain"] > 0 and tput["project_over_bare_lightning"] > 0
    assert [len(tput["paired_steps"][name]) for name in ("bare", "project")] == [1, 1]  # one round each
    assert "Paired steps" in md
    assert tput["data_ms_per_batch"] > 0
    startup = suites["startup"]["raw"]
    for name in ("project", "plain loop"):
        assert 0 < startup["first_step_s"][name][0] < startup["exit_s"][name][0], name
    for png in ("throughput.png", "startup.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.fast
def test_plug_in_suites_say_when_their_benchmark_is_missing(tmp_path, monkeypatch):
    from scripts.bench.context import Bench
    from scripts.bench.suites import collectives

    monkeypatch.setattr(collectives, "ENTRY", tmp_path / "missing.py")
    result = collectives.run(Bench(tmp_path, None))
    assert not result.rows and result.notes[0].startswith("not available")


@pytest.mark.fast
def test_bench_rejects_bad_options():
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "--suite", "throughput,nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown suite(s) nope" in proc.stderr


# -- --accelerator / --precision ------------------------------------------------------------------
def _captured_commands(monkeypatch, tmp_path, argv: list[str]) -> dict[str, list[str]]:
    """Run the throughput, start-up and accuracy suites (those chosen) with ``argv``, capturing each command.

    Nothing is launched: every run is recorded and reported as failed, and the in-process timings and
    charts are stubbed out.
    """
    from scripts.bench import measure
    from scripts.bench.__main__ import parse
    from scripts.bench.context import Bench
    from scripts.bench.suites import accuracy, startup, throughput

    args, settings = parse(argv)
    commands: dict[str, list[str]] = {}

    class CapturingBench(Bench):
        def run(self, name, make_cmd, world_size=1, threads=None, extra_env=None):
            commands[name] = [str(c) for c in make_cmd(self.out / "timelines" / name, self.out / "runs" / name)]
            return measure.Run(name, commands[name], 0.0, 1.0, 1, self.out / "logs" / f"{name}.log")

    monkeypatch.setattr(throughput, "project_batch_ms", lambda *args: 1.0)
    monkeypatch.setattr(throughput, "per_sample_batch_ms", lambda *args: 1.0)
    monkeypatch.setattr(throughput, "bar_chart", lambda *args, **kwargs: None)
    monkeypatch.setattr(startup, "import_seconds", lambda *args: 1.0)
    monkeypatch.setattr(startup, "grouped_bars", lambda *args, **kwargs: None)
    bench = CapturingBench(tmp_path, settings)
    chosen = [suite for suite in (throughput, startup, accuracy) if suite.__name__.rsplit(".", 1)[1] in args.suite]
    titles = [suite.run(bench).title for suite in chosen]
    assert all(settings.accelerator in t and settings.precision in t for t in titles), titles
    return commands


def _option(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@pytest.mark.fast
@pytest.mark.parametrize("accelerator,precision", [("gpu", "bf16-mixed"), ("gpu", "32-true"), ("cpu", "bf16-mixed")])
def test_accelerator_and_precision_reach_every_contender(monkeypatch, tmp_path, make_cfg, accelerator, precision):
    argv = ["--rounds", "1", "--batch-size", "512", "--workers", "0,2", "--accelerator", accelerator,
            "--precision", precision]
    commands = _captured_commands(monkeypatch, tmp_path, argv)
    expected = {"throughput-project-r0", "throughput-plain-loop-r0", "throughput-bare-Lightning-r0",
                "throughput-per-sample-0-workers-r0", "throughput-per-sample-2-workers-r0", "paired-bare-r0",
                "paired-project-r0", "startup-project-r0", "startup-plain-loop-r0", "accuracy-project-0",
                "accuracy-project-1", "accuracy-plain-2"}
    if accelerator == "gpu":  # an untimed step profile of each contender
        expected |= {"profile-project", "profile-bare-Lightning", "profile-plain-loop"}
    assert set(commands) == expected
    assert set(_captured_commands(monkeypatch, tmp_path / "unpaired", [*argv, "--no-paired", "--suite", "throughput"])
               ) == {name for name in expected if name.startswith(("throughput", "profile"))}
    for name, cmd in commands.items():
        if "src/train.py" in cmd:  # the project: explicit Hydra overrides (not the config's `auto`)
            assert f"trainer.accelerator={accelerator}" in cmd and f"trainer.precision={precision}" in cmd, name
            cfg = make_cfg("train", cmd[2:], subdir=name, tiny=False)  # the overrides compose as given
            assert (cfg.trainer.accelerator, cfg.trainer.precision) == (accelerator, precision), name
            if name.startswith(("throughput", "paired")):
                assert cfg.data.batch_size == 512, name
        else:  # plain loop, per-sample pipeline, bare Lightning
            assert cmd[1:3] in (["-m", "scripts.bench.plain_loop"], ["-m", "scripts.bench.bare_lightning"]), name
            assert (_option(cmd, "--accelerator"), _option(cmd, "--precision")) == (accelerator, precision), name


@pytest.mark.fast
def test_cpu_and_32_true_are_the_defaults_and_given_explicitly(monkeypatch, tmp_path):
    from scripts.bench import contenders
    from scripts.bench.__main__ import parse

    _, settings = parse([])
    assert (settings.accelerator, settings.precision) == ("cpu", "32-true")
    cmd = contenders.project(contenders.Work(epochs=2), tmp_path / "t", tmp_path / "r")
    assert "trainer.accelerator=cpu" in cmd and "trainer.precision=32-true" in cmd  # not the config's `auto`
    plain = contenders.plain(contenders.Work(epochs=2), tmp_path / "t")
    assert (_option(plain, "--accelerator"), _option(plain, "--precision")) == ("cpu", "32-true")
    with pytest.raises(ValueError, match="CPU in 32-true only"):  # plain DDP is gloo, CPU only
        contenders.plain_ddp(contenders.Work(epochs=2, accelerator="gpu"), tmp_path / "t", 2)
    for bad in (["--accelerator", "tpu"], ["--precision", "16-mixed"]):
        with pytest.raises(SystemExit) as exit_info:
            parse(bad)
        assert exit_info.value.code == 2


@pytest.mark.fast
def test_gpu_without_cuda_exits_2_with_one_line(tmp_path):
    out = tmp_path / "bench"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no CUDA device, even on a GPU machine
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "--suite", "throughput", "--accelerator", "gpu",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --accelerator gpu needs CUDA"), proc.stderr
    assert "--accelerator cpu" in lines[0] and not proc.stdout and not out.exists()


@pytest.mark.fast
@pytest.mark.parametrize("module", ["scripts.bench.plain_loop", "scripts.bench.bare_lightning"])
def test_contenders_refuse_gpu_without_cuda(monkeypatch, capsys, module):
    import importlib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:  # before any data is read
        importlib.import_module(module).main(["--accelerator", "gpu", "--data-dir", "/nonexistent"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: --accelerator gpu needs CUDA")


@pytest.mark.fast
def test_timeline_waits_for_the_gpu_only_at_span_ends(monkeypatch, tmp_path):
    from scripts.bench.timeline import Timeline

    for cuda in (False, True):
        timeline = Timeline(tmp_path / "t.json", cuda=cuda)
        timeline._written = True  # no file at exit
        synced = []  # (epoch, steps stamped so far in it) at each synchronize
        monkeypatch.setattr(torch.cuda, "synchronize",
                            lambda *args, t=timeline, out=synced: out.append(
                                (len(t.epochs), len(t.epochs[-1]["steps"]) if t.epochs else None)))
        for _epoch in range(2):
            timeline.epoch_start()
            for step in range(3):
                timeline.step_end(8, last=step == 2)
        # each epoch's start, the run's first step (time to first step) and each epoch's last step
        assert synced == ([(0, None), (1, 0), (1, 2), (1, 3), (2, 2)] if cuda else []), synced


# -- plain contenders' IDX reader, kernel-side measurements, same-round headlines -------------------
@pytest.mark.fast
def test_idx_reader_matches_torchvision_on_the_real_files():
    from torchvision.datasets.mnist import read_image_file, read_label_file

    from scripts.bench.data_pipeline import ensure_data
    from scripts.bench.plain_loop import read_idx

    ensure_data()  # extracts Fashion-MNIST into data/ as the bench does
    raw = ROOT / "data" / "FashionMNIST" / "raw"
    for split in ("train", "t10k"):
        images, labels = raw / f"{split}-images-idx3-ubyte", raw / f"{split}-labels-idx1-ubyte"
        ours, theirs = read_idx(images), read_image_file(str(images))
        assert ours.dtype == theirs.dtype == torch.uint8 and torch.equal(ours, theirs)
        assert torch.equal(read_idx(labels).long(), read_label_file(str(labels)))


@pytest.mark.fast
def test_idx_reader_big_endian_types_and_bad_files(tmp_path):
    import numpy as np
    from torchvision.datasets.mnist import read_sn3_pascalvincent_tensor

    from scripts.bench.plain_loop import read_idx

    values = np.array([[1, -2, 300], [70000, 0, -5]], dtype=">i4")
    path = tmp_path / "int32-idx2"
    path.write_bytes(bytes([0, 0, 0x0C, 2]) + np.array([2, 3], ">i4").tobytes() + values.tobytes())
    assert torch.equal(read_idx(path), read_sn3_pascalvincent_tensor(str(path), strict=False))
    assert read_idx(path).tolist() == values.tolist()
    for bad in (b"\x01\x00\x08\x01", bytes([0, 0, 8, 1]) + np.array([5], ">i4").tobytes() + b"abc"):
        path.write_bytes(bad)
        with pytest.raises(ValueError):
            read_idx(path)


@pytest.mark.fast
def test_plain_loop_does_not_import_torchvision():
    code = "import sys, scripts.bench.plain_loop; print(any(m.startswith('torchvision') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _measure(tmp_path, code: str, tty: bool = False):
    from scripts.bench import contenders, measure

    return measure.run("probe", [sys.executable, "-c", code], tmp_path / "timeline", tmp_path / "probe.log",
                       contenders.env(1), ROOT, world_size=0, tty=tty)


@pytest.mark.fast
@pytest.mark.parametrize("tty", [False, True])
def test_peak_rss_is_the_kernels_whole_process_high_water_mark(tmp_path, tty):
    from scripts.bench import measure

    # 200 MiB touched in an exit handler: after any reading a timeline could take at exit.
    run = _measure(tmp_path, "import atexit; atexit.register(lambda: len(b'x' * (200 * 2**20)))", tty)
    assert run.returncode == 0, run.error()
    assert measure.peak_rss_mb(run) == run.max_rss_mb >= 200
    # wait4: the max over the process and the children it waited for.
    run = _measure(tmp_path, "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                             "'len(bytes(1) * (300 * 2**20))'], check=True)")
    assert run.returncode == 0 and run.max_rss_mb >= 300, run.error()


@pytest.mark.fast
def test_peak_rss_does_not_inherit_the_harness_memory(tmp_path):
    # ru_maxrss survives execve and a fork starts from the parent's RSS: the launcher keeps ours out.
    ballast = b"x" * (400 * 2**20)
    run = _measure(tmp_path, "import sys; sys.exit(3)")
    assert len(ballast) and run.returncode == 3 and run.max_rss_mb < 200, run.max_rss_mb


GRANDCHILD = """
import subprocess, sys
burn = "import time; data = b'x' * (100 * 2**20)\\nwhile time.process_time() < 1.0: pass"
subprocess.Popen([sys.executable, '-c', burn])  # never waited for: outlives this process
"""


@pytest.mark.fast
def test_session_cpu_counts_a_grandchild_nobody_waits_for(tmp_path):
    run = _measure(tmp_path, GRANDCHILD)
    assert run.returncode == 0, run.error()
    others = {pid: p for pid, p in run.processes.items() if pid != run.pid}
    assert len(others) == 1, run.processes
    (grandchild,) = others.values()
    assert grandchild["cpu_s"] >= 0.6 and grandchild["hwm_mb"] >= 100, grandchild
    assert run.cpu_s >= grandchild["cpu_s"]
    # wait4's rusage alone would have missed it (the child itself may exit before the first poll).
    assert run.processes.get(run.pid, {}).get("cpu_s", 0.0) < 0.6
    assert not [pid for pid in others if _running(pid)]  # the harness waited for the whole session


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _timeline_run(tmp_path, timelines, pid=100, max_rss_mb=500.0, processes=None):
    from scripts.bench import measure

    return measure.Run("r", [], 0.0, 10.0, 0, tmp_path / "log", timelines, pid=pid, max_rss_mb=max_rss_mb,
                       processes=processes or {})


def _epoch(start, steps, samples, end=None):
    return {"start": start, "steps": steps, "samples": samples, **({"end": end} if end is not None else {})}


@pytest.mark.fast
def test_whole_epochs_include_validation_and_checkpoint_time(tmp_path):
    from scripts.bench import measure

    # Epochs: training 0-2 s then validation/checkpoint to 3 s; the last ends at its end stamp.
    rank0 = {"pid": 100, "epochs": [_epoch(0, [2], 64), _epoch(3, [5], 64), _epoch(6, [8], 64, end=9)]}
    rank1 = {"pid": 101, "epochs": [_epoch(0, [2], 64), _epoch(3, [5.5], 64), _epoch(6, [8], 64, end=9.5)]}
    run = _timeline_run(tmp_path, [rank0, rank1], processes={101: {"hwm_mb": 321.0, "cpu_s": 1.0, "ppid": 100}})
    assert measure.epoch_throughput(run) == pytest.approx(4 * 64 / 6.5)  # the slowest rank: 3 -> 9.5
    assert measure.loop_throughput(run) == pytest.approx(4 * 64 / (2.5 + 2))  # to each epoch's last step
    assert measure.epoch_wall_s(run) == pytest.approx(6.5 / 2)
    assert measure.rank_peak_rss_mb(run) == [500.0, 321.0]  # wait4 for the launched rank, VmHWM for the other
    del rank0["epochs"][-1]["end"]
    assert measure.epoch_throughput(run) is None  # no end stamp: not a whole epoch


@pytest.mark.fast
def test_headlines_are_medians_of_same_round_ratios():
    from scripts.bench.context import difference, headline, same_round

    project, plain = [90.0, 100.0, 50.0], [100.0, 100.0, 60.0]  # round 3 disturbed for both
    ratios = same_round(project, plain)
    assert ratios == pytest.approx([0.9, 1.0, 50 / 60])
    assert headline(ratios) == "0.900x (0.833-1.000x)"  # not best/best = 100/100
    assert headline(same_round([3.0, None], [1.0, 2.0], difference), "{:+.2f}", " s") == "+2.00 s (1 round)"
    assert headline(same_round([1.0, 4.0], [2.0, 2.0], difference), "{:+.2f}", " s") == "+0.50 s (-1.00 to +2.00 s)"
    assert headline([None]) == "-"


@pytest.mark.fast
def test_compile_suite_cost_gain_and_break_even(tmp_path, monkeypatch):
    """Made-up timelines through the compile suite: cost = first-epoch difference, break-even = cost / gain per epoch."""
    from scripts.bench import contenders
    from scripts.bench.context import Bench, Settings
    from scripts.bench.suites import compile as compile_suite

    batch = contenders.WORKLOADS["mlp"][0]

    def timeline(first_epoch_s: float, step_ms: float) -> dict:
        steps = [first_epoch_s]  # epoch 1: one long step (compilation), then a steady epoch of 10 steps
        second = [10 + step_ms / 1000 * (i + 1) for i in range(10)]
        return {"epochs": [_epoch(0, steps, batch), _epoch(10, second, 10 * batch, end=second[-1])]}

    fake = {"eager": (1.0, 5.0), "compiled": (31.0, 4.0)}  # 30 s to compile, then 1 ms faster per step

    def run(self, name, make_cmd, world_size=1, threads=None):
        kind = name.split("-")[1]
        return _timeline_run(tmp_path, [timeline(*fake[kind])])

    monkeypatch.setattr(Bench, "run", run)
    settings = Settings(rounds=2, epochs=2, limit_train_batches=10, accuracy_epochs=1, threads=1, workers=(),
                        nproc=2, tty=False, full=False)
    result = compile_suite.run(Bench(tmp_path, settings))
    assert result.raw["compile_cost_s"] == pytest.approx([30.0, 30.0])
    assert result.raw["gain_ms_per_step"] == pytest.approx([1.0, 1.0])
    # 30 s / (1 ms x 429 steps per Fashion-MNIST epoch) = 69.9 epochs
    assert result.raw["median_break_even_epochs"] == pytest.approx(30.0 / (0.001 * 429))

    fake["compiled"] = (31.0, 6.0)  # slower steps: never breaks even
    result = compile_suite.run(Bench(tmp_path, settings))
    assert result.raw["median_break_even_epochs"] is None
    assert "never breaks even" in " ".join(result.notes)


@pytest.mark.slow
def test_pipeline_worker_runs(tmp_path):
    """scripts/bench/pipeline_worker.py end to end on a tiny model (numbers meaningless): table and JSON come out."""
    from scripts.bench.pipeline_worker import markdown, run

    result = run(out=tmp_path, width=32, depth=2, batch=16, steps=1, warmup=1, rounds=1, micro_batches=(1, 2))
    # 1F1B needs m >= p = 2: no 1F1B row for m = 1
    assert [(r["schedule"], r["m"]) for r in result["rows"]] == [("GPipe", 1), ("GPipe", 2), ("1F1B", 2)]
    assert result["rows"][1]["ideal"] == pytest.approx(4 / 3)
    assert all(r["samples_per_s"] > 0 for r in result["rows"])
    assert "| 1F1B | 2 |" in markdown(result) and (tmp_path / "results.json").is_file()
