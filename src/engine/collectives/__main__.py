"""Check and measure the communication layer: message-passing examples, correctness suite, benchmark.

    python -m src.engine.collectives                                  # mode=check on 2 local gloo ranks
    python -m src.engine.collectives mode=blocking                    # send/recv rank 0 -> 1 (also non_blocking, all_reduce)
    python -m src.engine.collectives mode=bench nproc=3               # busbw sweep 1KB..64MB -> JSON, CSV, PNG in the run dir
    python -m src.engine.collectives mode=bench bench.sizes=[1MB,16MB] bench.iters=10
    python -m src.engine.collectives mode=ring                        # hand-written ring all-reduce vs dist.all_reduce
    python -m src.engine.collectives mode=sgd                         # hand-written synchronous SGD vs DDP
    torchrun --nproc_per_node=4 -m src.engine.collectives mode=check  # join ranks started by torchrun (or srun)

A module of the package (not a script in ``src/``) so the room keeps its own entry; run it from the
repository root, or anywhere once the project is installed (``make install``).
"""

from __future__ import annotations

import rootutils

# the project root on sys.path and in PROJECT_ROOT; .env is loaded by LoadDotenv (src/engine/utils/job_setup.py)
rootutils.setup_root(__file__, indicator=".project-root", pythonpath=True, dotenv=False)

from src.engine.runtime import prompt_exit  # noqa: E402

if __name__ == "__main__":
    prompt_exit.install()  # before the imports below register their atexit handlers: it must run after them

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from src.engine.collectives.launch import RankFailed, launch, plan_from_config  # noqa: E402
from src.engine.collectives.runtime import CollectiveError  # noqa: E402
from src.engine.utils.errors import UserError, exit_with_error  # noqa: E402
from src.engine.utils.resolvers import register_resolvers  # noqa: E402

register_resolvers()


@hydra.main(version_base="1.3", config_path="../../../configs", config_name="collectives")
def main(cfg: DictConfig) -> None:
    """Validate the config in this process, then run the mode on every rank.

    A bad option exits 2 with one line naming the fix; a failed check or a crashed rank exits 1.
    """
    try:
        plan = plan_from_config(cfg, HydraConfig.get().runtime.output_dir)
    except UserError as err:
        exit_with_error(str(err))
    if plan.external is None or plan.external.rank == 0:
        for note in plan.notes:
            print(f"note: {note}", flush=True)
    try:
        launch(plan)
    except (RankFailed, CollectiveError) as err:
        exit_with_error(str(err).splitlines()[0], code=1)


if __name__ == "__main__":
    with prompt_exit.exit_code_recorded():  # then end without the interpreter's teardown (torchrun ranks too)
        main()
