"""Bad input: one clear line naming the fix, a non-zero exit, and nothing already saved is touched."""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from src.data.mnist_datamodule import FashionMNISTDataModule, MNISTDataModule
from src.engine.utils.errors import CheckpointError, ConfigError, DataError, print_error
from tests.helpers.config import ROOT
from tests.helpers.entry import run_entry

FASHION_RAW = ROOT / "data" / "FashionMNIST" / "raw"


def error_line(proc) -> str:
    """The entry points print exactly one line for a user error; return it."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def test_unknown_option_is_rejected_by_hydra(tmp_path):
    proc = run_entry("train", "trainer.no_such_option=1", f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2
    line = error_line(proc)
    assert "trainer.no_such_option is not a key" in line and "+trainer.no_such_option" in line
    assert not (tmp_path / "run").exists()  # refused before Hydra made the run dir


@pytest.mark.parametrize(("override", "message"), [
    ("model.optimizer.lr=abc", "model.optimizer is invalid: torch.optim.Adam says"),
    ("trainer.max_epochs=-3", "trainer.max_epochs=-3 must be >= 0, or -1 for no limit"),
    ("data.num_workers=-1", "data.num_workers=-1 must be 0 or more"),
    ("model.scheduler={_target_:torch.optim.lr_scheduler.ReduceLROnPlateau,_partial_:true,factor:2}",
     "model.scheduler is invalid: torch.optim.lr_scheduler.ReduceLROnPlateau says 'Factor should be < 1.0.'"),
])
def test_a_value_torch_or_lightning_refuses_later_is_one_line_now(tmp_path, override, message):
    proc = run_entry("train", override, f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in error_line(proc)
    assert len(proc.stderr.strip().splitlines()) == 1, "nothing else on stderr (no traceback, no Lightning lines)"
    assert not (tmp_path / "run").exists(), "a refused run leaves no run directory"


@pytest.mark.parametrize("batch", ["0", "-4"])
def test_non_positive_batch_size(tmp_path, batch):
    proc = run_entry("train", f"data.batch_size={batch}", f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2
    assert "is not a positive integer; fix: set the global batch" in error_line(proc)


def test_bad_sigterm_check_interval(tmp_path):
    proc = run_entry("train", "trainer=ddp", "trainer.strategy.sigterm_check_every_n_batches=0",
                     f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2
    line = error_line(proc)
    assert "sigterm_check_every_n_batches=0 must be an integer >= 1" in line
    # the strategy's constructor refused it, inside Hydra's instantiate: Lightning's start-up lines still held
    assert proc.stderr.strip().splitlines() == [line], "nothing else on stderr (no Lightning start-up lines)"


@pytest.mark.fast
@pytest.mark.parametrize(("strategy", "options", "message"), [
    ("DDPStrategy", {"bogus": 1}, "trainer.strategy.bogus is not an option of trainer=ddp; fix: remove it"),
    ("DDPStrategy", {"find_unused_parameters": True}, None),  # Lightning hands it to torch's DDP
    ("FSDPStrategy", {"find_unused_parameters": True}, "is a trainer=ddp setting, but this run uses trainer=fsdp"),
    ("DataParallelStrategy", {"hang_timeout_s": 5}, "is a trainer=ddp setting, but this run uses trainer=dp"),
    ("ParameterServerStrategy", {"sharding_strategy": "full"}, "is a trainer=fsdp setting, but this run uses trainer=ps"),
    # a base class's option that the strategy's constructor does not pass on is refused, not dropped
    ("FSDPStrategy", {"tensor_parallel_size": 2}, "trainer.strategy.tensor_parallel_size is not an option of trainer=fsdp"),
    ("DataParallelStrategy", {"cluster_environment": None}, "cluster_environment is a trainer=ddp setting"),
    ("SingleDeviceStrategy", {"bogus": 1}, "trainer.strategy.bogus is not an option of trainer=default; fix: remove"),
    ("SingleDeviceStrategy", {"num_servers": 1}, "is a trainer=ps setting, but this run uses trainer=default"),
    ("SingleDeviceStrategy", {"accelerator": None}, None),  # Lightning's own keyword
])
def test_a_strategy_option_is_checked_against_the_strategy_that_takes_it(strategy, options, message):
    import src.engine.strategies

    build = getattr(src.engine.strategies, strategy)
    if message is None:
        build(**options)
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        build(**options)


def test_an_unknown_ddp_option_stops_before_any_rank_starts(tmp_path):
    proc = run_entry("train", "trainer=ddp", "trainer.devices=2", "+trainer.strategy.bogus=1",
                     f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = error_line(proc)
    assert "trainer.strategy.bogus is not an option of trainer=ddp" in line
    assert proc.stderr.strip().splitlines() == [line], "no rank started, nothing else printed"


def test_an_unknown_single_device_option_is_one_line(tmp_path):
    proc = run_entry("train", "trainer=cpu", "+trainer.strategy.bogus=1", f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = error_line(proc)
    assert "trainer.strategy.bogus is not an option of trainer=default" in line
    assert proc.stderr.strip().splitlines() == [line]


def test_batch_not_divisible_by_replicas_fails_before_launch(tmp_path):
    proc = run_entry(
        "train",
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "data.batch_size=127",
        f"paths.log_dir={tmp_path}",
    )
    assert proc.returncode == 2
    line = error_line(proc)
    assert "must divide evenly across 2" in line and "multiple of 2" in line
    assert "MEMBER" not in proc.stderr  # no rank was started
    assert (tmp_path / "train" / "runs").is_dir() and not list((tmp_path / "train" / "runs").iterdir()), \
        "a refused run leaves no run directory"
    assert proc.stderr.strip().splitlines() == [line], "nothing else on stderr (no Lightning start-up lines)"


@pytest.mark.fast
def test_missing_data_names_the_fixes(tmp_path):
    dm = FashionMNISTDataModule(data_dir=str(tmp_path), system_dir=str(tmp_path / "nowhere"), download=False)
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist") as err:
        dm.prepare_data()
    assert str(tmp_path) in str(err.value)


@pytest.mark.fast
def test_an_error_with_a_cause_of_many_lines_is_printed_as_one(capsys):
    print_error("mnist not found and the download failed: Tried a, got:\n<urlopen error>\nTried b; fix: copy it")
    assert capsys.readouterr().err == "error: mnist not found and the download failed: Tried a, got: <urlopen error> " \
                                      "Tried b; fix: copy it\n"


@pytest.mark.fast
def test_corrupt_data_file_is_named(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    FashionMNISTDataModule(data_dir=str(ROOT / "data")).prepare_data()
    for path in FASHION_RAW.iterdir():
        shutil.copy(path, raw / path.name)
    bad = raw / "train-images-idx3-ubyte"
    bad.write_bytes(bad.read_bytes()[:1000])  # truncated
    dm = FashionMNISTDataModule(data_dir=str(tmp_path), download=False)
    with pytest.raises(DataError, match="corrupt data file .*train-images-idx3-ubyte"):
        dm.setup()


@pytest.mark.fast
def test_truncated_system_archive_is_named(tmp_path):
    system = tmp_path / "system"
    system.mkdir()
    for name in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        with gzip.open(system / f"{name}.gz", "wb") as f:
            f.write(b"\x00" * 64)
    (system / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b\x08garbage")
    dm = MNISTDataModule(data_dir=str(tmp_path / "data"), system_dir=str(system), download=False)
    with pytest.raises(DataError, match="cannot extract .*train-images-idx3-ubyte.gz"):
        dm.prepare_data()
    assert list(dm.raw_dir.iterdir()) == [], "nothing half-extracted is left to be read as data"


def test_missing_checkpoint_fails_before_training(tmp_path):
    proc = run_entry("train", f"ckpt_path={tmp_path}/nope.ckpt", f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2
    assert "does not exist" in error_line(proc)
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing was trained


@pytest.mark.fast
def test_unreadable_checkpoint(tmp_path, make_cfg):
    from src.engine.checkpointing.start import check_checkpoint

    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        check_checkpoint(junk, model, OmegaConf.create({}))


def test_checkpoint_from_another_model(make_cfg, tmp_path):
    from src.train import train

    _, objects = train(make_cfg("train", ["test=false", "++trainer.limit_train_batches=1"], subdir="mlp"))
    ckpt = objects["trainer"].checkpoint_callback.best_model_path
    before = Path(ckpt).read_bytes()
    proc = run_entry("eval", f"ckpt_path={ckpt}", "model=resnet18", f"hydra.run.dir={tmp_path}/eval",
                     f"paths.log_dir={tmp_path}/logs")
    assert proc.returncode == 2
    line = error_line(proc)
    assert "does not fit this model" in line and "missing" in line
    assert Path(ckpt).read_bytes() == before  # the checkpoint is untouched
    assert (tmp_path / "logs" / ".pids").is_dir() and not list((tmp_path / "logs" / ".pids").glob("*.json"))


def test_non_writable_output_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    proc = run_entry("train", f"hydra.run.dir={blocker}/run")
    assert proc.returncode == 2
    assert "a_file is a file, not a directory" in error_line(proc)
    assert blocker.read_text() == "keep me"


@pytest.mark.fast
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer=ddp", "trainer.accelerator=gpu"], "no CUDA GPU is visible"),
        (
            ["trainer=ddp", "trainer.strategy.process_group_backend=nccl", "trainer.accelerator=cpu"],
            "nccl needs CUDA",
        ),
        (
            ["trainer=ddp", "trainer.strategy.process_group_backend=mpi", "trainer.accelerator=cpu"],
            "no MPI support",
        ),
        (
            ["trainer=ddp", "trainer.strategy.process_group_backend=ucc", "trainer.accelerator=cpu"],
            "process_group_backend='ucc' is unknown",
        ),
        (["trainer.num_nodes=0"], "num_nodes=0"),
        (
            ["trainer=ddp", "trainer.sync_batchnorm=true", "trainer.accelerator=cpu"],
            "SyncBatchNorm is GPU-only",
        ),
        (["model=toy"], "use data=toy"),
        (["data=toy"], "use model=toy"),
        (["trainer.max_epochs=x"], "must be a whole number"),  # Lightning: a bare assert in the fit loop
        (["trainer.num_nodes=two"], "must be a whole number"),
        (["++trainer.limit_train_batches=all"], "must be a number"),
    ],
)
def test_impossible_combinations(make_cfg, overrides, message, monkeypatch, capsys):
    from src.train import train

    monkeypatch.setattr(
        torch.cuda, "device_count", lambda: 0
    )  # cases of a machine without GPUs, whatever this one has
    if "mpi" in " ".join(overrides) and torch.distributed.is_mpi_available():
        pytest.skip("this torch has MPI")
    with pytest.raises(SystemExit) as exc:
        train(make_cfg("train", overrides))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.fast
def test_ddp_fork_after_cuda_was_initialized_is_one_line(make_cfg, monkeypatch, capsys):
    """A forked rank cannot use a CUDA context its parent made (torch raises in every rank): refused before the fork."""
    from src.train import train

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(SystemExit) as exc:
        train(make_cfg("train", ["trainer=ddp_fork", "trainer.accelerator=cpu"]))
    assert exc.value.code == 2
    assert "CUDA is already initialized in this process" in capsys.readouterr().err


@pytest.mark.fast
def test_impossible_combination_messages(make_cfg, capsys):
    from src.train import train

    with pytest.raises(SystemExit):
        train(
            make_cfg(
                "train",
                ["trainer=ddp", "trainer.strategy.process_group_backend=nccl", "trainer.accelerator=cpu"],
            )
        )
    assert "process_group_backend=nccl needs CUDA GPUs" in capsys.readouterr().err


@pytest.mark.fast
def test_busy_master_port_is_reported(monkeypatch):
    import socket

    from src.engine.runtime.rendezvous import check_rendezvous

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        with pytest.raises(ConfigError, match="already in use"):
            check_rendezvous(num_nodes=1)


def test_existing_checkpoints_are_not_overwritten(tmp_path):
    ckpt_dir = tmp_path / "run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "last.ckpt").write_bytes(b"earlier run")
    proc = run_entry("train", f"hydra.run.dir={tmp_path}/run", "auto_resume=false")
    assert proc.returncode == 2
    assert "already holds checkpoints" in error_line(proc)
    assert (ckpt_dir / "last.ckpt").read_bytes() == b"earlier run"


# -- one line + exit 2 for every bad input, Hydra's own errors included ------------------------------------
TOY = [
    "model=toy",
    "data=toy",
    "trainer.accelerator=cpu",
    "trainer.max_epochs=1",
    "++trainer.limit_train_batches=2",
    "++trainer.limit_val_batches=1",
    "++trainer.limit_test_batches=1",
    "extras.print_config=false",
]


def one_line_exit_2(proc) -> str:
    """Exit 2, exactly one ``error: ...; fix: ...`` line, no traceback from any process; returns the line."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = error_line(proc)
    assert "; fix: " in line, line
    return line


def test_eval_without_ckpt_path(tmp_path):
    proc = run_entry("eval", *TOY, f"hydra.run.dir={tmp_path}/eval")
    line = one_line_exit_2(proc)
    assert "ckpt_path" in line and "ckpt_path=" in line.split("fix:")[1]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer=nope", ["trainer=nope", "ddp", "ddp_spawn", "pipeline"]),
        (
            "trainer.max_epoch=3",
            ["trainer.max_epoch", "did you mean trainer.max_epochs", "+trainer.max_epoch=3"],
        ),
        ("trainer.max_epochs=[1", ["trainer.max_epochs=[1", "key=value"]),
        ("~trainer.no_such_key", ["trainer.no_such_key"]),
    ],
)
def test_hydra_errors_are_one_line(tmp_path, override, expected):
    proc = run_entry("train", override, f"hydra.run.dir={tmp_path}/run")
    line = one_line_exit_2(proc)
    for text in expected:
        assert text in line, line
    assert "HYDRA_FULL_ERROR" not in proc.stderr


def test_hydra_errors_in_eval_too(tmp_path):
    line = one_line_exit_2(
        run_entry("eval", "ckpt_path=x.ckpt", "model=nope", f"hydra.run.dir={tmp_path}/eval")
    )
    assert "model=nope" in line and "mlp" in line


def test_hydra_full_error_set_by_the_user_keeps_the_trace(tmp_path):
    proc = run_entry(
        "train", "trainer.max_epoch=3", f"hydra.run.dir={tmp_path}/run", env={"HYDRA_FULL_ERROR": "1"}
    )
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ConfigCompositionException" in proc.stderr


@pytest.mark.fast
def test_a_bug_in_the_job_still_shows_its_traceback(tmp_path):
    """The one-line rule is for bad input only: an entry point whose job has a bug (here, a RuntimeError and an
    omegaconf error from reading a key that does not exist) still prints the whole traceback and exits 1."""
    script = tmp_path / "entry.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from src.engine.utils.hydra_errors import hydra_main\n"
        "from src.engine.utils.resolvers import register_resolvers\n"
        "register_resolvers()\n"
        f"@hydra_main(version_base='1.3', config_path={str(ROOT / 'configs')!r}, config_name='train.yaml')\n"
        "def main(cfg):\n"
        "    if cfg.seed == 1:\n"
        "        raise RuntimeError('a bug')\n"
        "    return cfg.no_such_key_in_code\n"
        "main()\n"
    )
    for seed, name in (("1", "RuntimeError: a bug"), ("2", "ConfigAttributeError")):
        proc = subprocess.run(
            [sys.executable, str(script), f"seed={seed}", f"hydra.run.dir={tmp_path}/run"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "Traceback" in proc.stderr and name in proc.stderr
        assert not [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("port", ["abc", "99999", "0"])
def test_bad_master_port_fails_before_any_rank_starts(tmp_path, port):
    proc = run_entry(
        "train",
        *TOY,
        "trainer=ddp",
        "trainer.devices=2",
        f"hydra.run.dir={tmp_path}/run",
        env={"MASTER_PORT": port},
    )
    line = one_line_exit_2(proc)
    assert f"MASTER_PORT={port}" in line and "1-65535" in line
    assert "MEMBER" not in proc.stderr  # no rank was started


def test_negative_learning_rate_is_a_config_error(tmp_path):
    proc = run_entry("train", *TOY, "model.optimizer.lr=-0.1", f"hydra.run.dir={tmp_path}/run")
    line = one_line_exit_2(proc)
    assert "model.optimizer.lr=-0.1" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.fast
@pytest.mark.parametrize(
    ("key", "value", "named"),
    [("weight_decay", "-1", "model.optimizer.weight_decay=-1"), ("betas", "[1.5,0.9]", "beta")],
)
def test_other_invalid_optimizer_values(make_cfg, key, value, named):
    from src.engine.utils.config_checks import check_config

    cfg = make_cfg(
        "train", [f"model.optimizer.{key}={value}" if key != "betas" else f"+model.optimizer.betas={value}"]
    )
    with pytest.raises(ConfigError, match=named):
        check_config(cfg)


def test_all_devices_on_cpu(tmp_path):
    """``trainer.devices=-1`` means every GPU; Lightning has no "every CPU" (it raises a TypeError there)."""
    line = one_line_exit_2(run_entry("train", *TOY, "trainer.devices=-1", f"hydra.run.dir={tmp_path}/run"))
    assert "trainer.devices=-1" in line and "CPU" in line and "trainer.devices=2" in line


@pytest.mark.fast
def test_zero_devices_on_cpu_does_not_recommend_minus_one(make_cfg, monkeypatch):
    from src.engine.utils.config_checks import check_trainer_config

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="trainer.devices=0 must be >= 1") as err:
        check_trainer_config(make_cfg("train", ["trainer.devices=0"]).trainer)
    assert "-1" not in str(err.value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="-1 for every GPU"):
        check_trainer_config(make_cfg("train", ["trainer.devices=0", "trainer.accelerator=gpu"]).trainer)


def test_dp_batch_smaller_than_devices_fails_before_training(tmp_path):
    line = one_line_exit_2(
        run_entry(
            "train",
            *TOY,
            "trainer=dp",
            "trainer.devices=2",
            "data.batch_size=1",
            f"hydra.run.dir={tmp_path}/run",
        )
    )
    assert "data.batch_size=1" in line and "2 dp devices" in line


class _PlainDataModule(L.LightningDataModule):
    """A user's DataModule: not one of the project's (no ``batch_size_is_global``)."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.save_hyperparameters()


@pytest.mark.fast
def test_dp_batch_check_covers_any_datamodule():
    """dp splits whatever batch the loader yields: a user's DataModule with batch_size=1 on 2 dp devices failed
    only at the first training step; the pre-flight catches it."""
    from src.engine.strategies.dp import DataParallelStrategy
    from src.engine.strategies.launchers import preflight
    from src.models.components.toy_net import ToyNet
    from src.models.regression_module import RegressionModule

    trainer = L.Trainer(
        strategy=DataParallelStrategy(),
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = RegressionModule(net=ToyNet(10, 10, 5), optimizer=torch.optim.SGD)
    with pytest.raises(ConfigError, match="batch_size=1 cannot give each of the 2 dp devices"):
        preflight(trainer, model, _PlainDataModule(batch_size=1))
    preflight(trainer, model, _PlainDataModule(batch_size=2))


@pytest.mark.parametrize("where", ["proc", "under_a_file"])
def test_unwritable_data_dir(tmp_path, where):
    """The default data (Fashion-MNIST) is extracted into data_dir: one that cannot be created fails before any
    rank starts. (A chmod'ed folder would not do: tests may run as root.)"""
    if where == "proc":
        data_dir = "/proc/nope"
    else:
        (tmp_path / "afile").write_text("keep me")
        data_dir = f"{tmp_path}/afile/data"
    proc = run_entry(
        "train", f"paths.data_dir={data_dir}", "extras.print_config=false", f"hydra.run.dir={tmp_path}/run"
    )
    line = one_line_exit_2(proc)
    assert data_dir in line and "paths.data_dir=" in line.split("fix:")[1]


@pytest.mark.fast
def test_data_dir_check_needs_no_write_when_the_files_are_there(tmp_path):
    """A read-only data_dir that already holds the files is fine: only a missing file needs writing."""
    dm = FashionMNISTDataModule(data_dir=str(ROOT / "data"))
    dm.prepare_data()
    dm.check_data_dir()  # present: nothing to check
    with pytest.raises(DataError, match="cannot write the fashion_mnist files into /proc/nope"):
        FashionMNISTDataModule(data_dir="/proc/nope").check_data_dir()


def _checkpoint_case(tmp_path: Path, kind: str) -> Path:
    if kind == "random bytes":
        path = tmp_path / "random.ckpt"
        path.write_bytes(
            torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
            .numpy()
            .tobytes()
        )
    elif kind == "empty":
        path = tmp_path / "empty.ckpt"
        path.write_bytes(b"")
    else:
        path = tmp_path / "checkpoints"
        path.mkdir()
        (path / "last.ckpt").write_bytes(b"")
    return path


@pytest.mark.parametrize(
    ("kind", "named"),
    [("random bytes", "corrupt"), ("empty", "is empty (0 bytes"), ("directory", "is a directory")],
)
def test_bad_checkpoint_files(tmp_path, kind, named):
    path = _checkpoint_case(tmp_path, kind)
    line = one_line_exit_2(run_entry("eval", *TOY, f"ckpt_path={path}", f"hydra.run.dir={tmp_path}/eval"))
    assert named in line and str(path) in line
    assert "weights_only" not in line
    if kind == "directory":
        assert f"ckpt_path={path / 'last.ckpt'}" in line


@pytest.mark.fast
def test_checkpoint_messages_never_advise_unsafe_loading(tmp_path):
    from src.engine.checkpointing.start import check_checkpoint

    path = tmp_path / "code.ckpt"
    torch.save(
        {"state_dict": {}, "hook": print}, path
    )  # a pickled global: torch's message says weights_only=False
    with pytest.raises(CheckpointError) as err:
        check_checkpoint(path, torch.nn.Linear(2, 2), OmegaConf.create({}))
    assert "weights_only" not in str(err.value) and "\n" not in str(err.value)
    assert "Python objects other than tensors" in str(err.value) and "trust_checkpoint=true" in str(err.value)


@pytest.mark.fast
def test_every_error_message_in_src_says_its_fix():
    """Each ``ConfigError``/``DataError``/``CheckpointError``/``UserError`` raised with a message written in
    place says what is wrong and, once, ``fix:`` what to do (docs/bad-input.md)."""
    import ast

    errors = {"UserError", "ConfigError", "DataError", "CheckpointError"}

    def text(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(text(v) or "{}" for v in node.values)
        if isinstance(node, ast.BinOp):
            return (text(node.left) or "{}") + (text(node.right) or "{}")
        return None

    found, wrong = 0, []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "func", None)
            name = getattr(name, "id", getattr(name, "attr", None))
            if isinstance(node, ast.Call) and name in errors and node.args and text(node.args[0]) is not None:
                found += 1
                message = text(node.args[0])
                if message.count("fix:") != 1 and not message.startswith("{}"):  # "{}...": built by a helper
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {message[:90]}")
    assert found > 100 and not wrong, "\n".join(wrong)
