"""The `dfo` command line. Thin: each sub-module of orchestrator/commands registers its commands here.

No SSH, SQL or decision logic lives in the CLI: commands parse options, call the library and render.
DfoError becomes a one-line message on stderr and its exit code (2 usage/inventory, 1 everything else).
Only typer's public API is used (`typer.Typer(cls=...)` with a `typer.core.TyperGroup`, `typer.Exit`), so the
CLI runs on every typer from the floor pyproject.toml declares (scripts/floor.sh checks it) to the newest.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

from .errors import DfoError


class DfoGroup(TyperGroup):
    """The root command: a DfoError raised by any command becomes its one-line message and exit code, and
    Ctrl-C says that remote runs were left running (exit 130). Both are taken here, inside click's own
    handling, so that `dfo` and typer's CliRunner behave alike."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DfoError as err:
            from .commands.common import print_error

            print_error(err)
            raise typer.Exit(err.exit_code) from None
        except KeyboardInterrupt:
            # Ctrl-C stops dfo, never a remote run: nothing remote is signalled on the way out.
            sys.stderr.write("interrupted: remote runs were left running\n")
            raise typer.Exit(130) from None


app = typer.Typer(
    name="dfo",
    cls=DfoGroup,
    help=(
        "Drive GPU training experiments in Proxmox LXC containers over SSH: preflight the GPUs, launch "
        "detached runs, watch them until they are steady (or fall back to the next variant), run batches."
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help text is shown as written: `[group]` is not read as rich markup
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("dfo")
        except PackageNotFoundError:  # run from a source tree that was never installed
            from . import __version__ as number
        sys.stdout.write(f"dfo {number}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    show_version: Annotated[bool, typer.Option("--version", help="Print dfo's version and exit.", is_eager=True,
                                               callback=_version)] = False,
) -> None:
    pass


def _register_commands() -> None:
    import importlib

    for module in ("inventory", "preflight", "runs", "watch", "batch", "replay", "metrics", "ui"):
        importlib.import_module(f"orchestrator.commands.{module}").register(app)


_register_commands()


def main() -> None:
    """Console-script entry point."""
    app(prog_name="dfo")
