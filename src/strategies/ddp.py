"""``DDPStrategy``: Lightning's DDP, plus a process group that is torn down before Python exits.

Lightning leaves a gloo process group alive until interpreter shutdown, which can abort a rank
that exits right after a collective (see :mod:`src.strategies.exit_cleanup`). Everything
else, the launchers (``popen``/``spawn``), cluster environments and gradient sync, is
Lightning's own.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy

from src.strategies.exit_cleanup import destroy_default_group_at_exit


class DDPStrategy(LightningDDPStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`; the group is destroyed at exit."""

    def setup_distributed(self) -> None:
        super().setup_distributed()
        destroy_default_group_at_exit()
