"""The `dfo` command line. Thin: each sub-module of orchestrator/commands registers its commands here.

No SSH, SQL or decision logic lives in the CLI: commands parse options, call the library and render.
DfoError becomes a one-line message on stderr and its exit code (2 usage/inventory, 1 everything else).
"""

from __future__ import annotations

import sys

import typer
from typer.core import TyperArgument, TyperOption

from .errors import DfoError

app = typer.Typer(
    name="dfo",
    help=(
        "Drive GPU training experiments in Proxmox LXC containers over SSH: preflight the GPUs, launch "
        "detached runs, watch them until they are steady (or fall back to the next variant), run batches."
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
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
    show_version: bool = typer.Option(False, "--version", help="Print dfo's version and exit.", is_eager=True,
                                      callback=_version),
) -> None:
    pass


def _register_commands() -> None:
    import importlib

    for module in ("inventory", "preflight", "runs", "watch", "batch", "replay", "metrics"):
        importlib.import_module(f"orchestrator.commands.{module}").register(app)


_register_commands()


SECONDS_NAMES = ("timeout", "grace", "interval", "poll")


def readable_placeholders(command):
    """`--help` placeholders as words: flags show none (not `<bool>`), an option without a metavar shows its
    name (`--variant VARIANT`) or SECONDS/N, and an argument shows only its own metavar (not `NAME <str>`)."""
    for param in command.params:
        if isinstance(param, TyperOption) and param.metavar is None:
            if param.is_flag or param.count:
                param.metavar = ""
            elif any(word in param.name for word in SECONDS_NAMES) or param.name.endswith("_s"):
                param.metavar = "SECONDS"
            elif getattr(param.type_descriptor, "annotation", None) is int:
                param.metavar = "N"
            else:
                param.metavar = param.name.upper()
        elif isinstance(param, TyperArgument):
            param.metavar = param.metavar or param.name.upper()
            param.display_type_rich = lambda ctx: None  # typer would add `<str>` after the argument's name
    make_help_option = command.get_help_option

    def help_option(ctx, make=make_help_option):
        option = make(ctx)
        if option is not None:
            option.metavar = ""  # --help is a flag too
        return option

    command.get_help_option = help_option
    for sub in getattr(command, "commands", {}).values():
        readable_placeholders(sub)
    return command


def main() -> None:
    """Console-script entry point: run the app, turning DfoError into a message and an exit code."""
    try:
        rc = readable_placeholders(typer.main.get_command(app)).main(prog_name="dfo", standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except DfoError as err:
        from .commands.common import print_error

        print_error(err)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        # Ctrl-C stops dfo, never a remote run: nothing remote is signalled on the way out.
        sys.stderr.write("interrupted: remote runs were left running\n")
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as exc:  # click's own usage errors arrive here in non-standalone mode
        import click

        try:  # recent typer vendors click as typer._click, with its own exception classes
            from typer._click import exceptions as vendored
        except ImportError:
            vendored = click.exceptions
        if isinstance(exc, (click.exceptions.ClickException, vendored.ClickException)):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, (click.exceptions.Abort, typer.Abort)):
            sys.stderr.write("aborted\n")
            sys.exit(130)
        raise
