"""--help as plain text, grouped by each option's panel.

Typer's rich help draws a box per panel with six columns, which at 80 columns cuts option names and
help short ("--vllm-prefix-cach…") and labels every switch `<bool>`. Click's own layout never cuts a
name and shows switches bare; this command class keeps the grouping on top of it.
"""

from __future__ import annotations

import click
from typer.core import TyperCommand

DEFAULT_PANEL = "Options"


class GroupedHelpCommand(TyperCommand):
    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        panels: dict[str, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            default = "Arguments" if param.param_type_name == "argument" else DEFAULT_PANEL
            panels.setdefault(getattr(param, "rich_help_panel", None) or default, []).append(record)
        for name, records in panels.items():
            with formatter.section(name):
                formatter.write_dl(records)
