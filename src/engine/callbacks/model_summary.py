"""Lightning's rich model summary, with FLOPs shown only when they were measured."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import callbacks
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
from rich import get_console
from rich.table import Table

RIGHT_ALIGNED = ("Params", "Params per Device", "In sizes", "Out sizes")


class RichModelSummary(callbacks.RichModelSummary):
    """Leaves out the FLOPs column and the "Total FLOPs" line when nothing was counted.

    Lightning counts FLOPs in one forward pass on the module's ``example_input_array``. Without one,
    every count is 0, and a column of zeros reads like a measurement.
    """

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int = 0,  # lightning 2.5 counts no FLOPs and passes none
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            callbacks.RichModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                                 total_training_modes, total_flops, **summarize_kwargs)
            return
        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(name, justify="right" if name in RIGHT_ALIGNED else "left",
                             style="dim" if name == " " else None, no_wrap=name == "Name")
        for row in zip(*(values for _, values in columns), strict=True):
            table.add_row(*row)
        grid = Table.grid(expand=True)
        grid.add_column()
        for label, value in (
            ("Trainable params", get_human_readable_count(trainable_parameters)),
            ("Non-trainable params", get_human_readable_count(total_parameters - trainable_parameters)),
            ("Total params", get_human_readable_count(total_parameters)),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", total_training_modes["train"]),
            ("Modules in eval mode", total_training_modes["eval"]),
        ):
            grid.add_row(f"[bold]{label}[/]: {value}")
        console = get_console()
        console.print(table)
        console.print(grid)
