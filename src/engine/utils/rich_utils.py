"""Print the composed config as a rich tree (rank 0) and save it next to the run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import rich
import rich.syntax
import rich.tree
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

DEFAULT_ORDER = ("data", "model", "trainer", "callbacks", "logger", "paths", "extras")


@rank_zero_only
def print_config_tree(cfg: DictConfig, order: Sequence[str] = DEFAULT_ORDER, save_to_file: bool = False) -> None:
    tree = rich.tree.Tree("CONFIG", style="dim", guide_style="dim")
    fields = [f for f in order if f in cfg] + [f for f in cfg if f not in order and f != "hydra"]
    for field in fields:
        branch = tree.add(field, style="bold", guide_style="dim")
        node = cfg[field]
        text = OmegaConf.to_yaml(node, resolve=True) if isinstance(node, DictConfig) else str(node)
        branch.add(rich.syntax.Syntax(text, "yaml"))
    rich.print(tree)
    if save_to_file:
        with open(Path(cfg.paths.output_dir, "config_tree.log"), "w") as file:
            rich.print(tree, file=file)
