"""The `dfo` command line. Thin: each sub-module of orchestrator/commands registers its commands here.

No SSH, SQL or decision logic lives in the CLI: commands parse options, call the library and render.
DfoError becomes a one-line message on stderr and its exit code (2 usage/inventory, 1 everything else).
"""

from __future__ import annotations

import sys

import typer

from .errors import DfoError

app = typer.Typer(
    name="dfo",
    help=(
        "Drive GPU training experiments in Proxmox LXC containers over SSH: preflight the GPUs, launch "
        "detached runs, watch them until they are steady (or fall back to the next variant), run batches."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _register_commands() -> None:
    import importlib

    for module in ("inventory", "preflight", "runs", "watch", "batch", "replay", "metrics"):
        importlib.import_module(f"orchestrator.commands.{module}").register(app)


_register_commands()


def main() -> None:
    """Console-script entry point: run the app, turning DfoError into a message and an exit code."""
    try:
        rc = app(standalone_mode=False)
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
