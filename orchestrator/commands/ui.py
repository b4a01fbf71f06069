"""`dfo ui`: serve the dashboard (orchestrator/ui/) until Ctrl-C or SIGTERM.

Binds its socket before printing anything, so the first line on stdout is the URL that works (the port
`--port 0` got, the token of a widened bind) and a busy port is one line and exit 1, nothing served.
"""

from __future__ import annotations

import errno
import secrets
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import DfoError, UsageError
from ..inventory import load_inventory
from ..store import Store
from ..ui import is_loopback
from .common import InventoryOpt, say

DEFAULT_PORT = 8765
EXAMPLE = ("Example: dfo ui   |   dfo ui --port 9000 -i lab.yaml   |   dfo ui --host 0.0.0.0   "
           "(reachable from elsewhere: the URL it prints carries a token)")


def register(app: typer.Typer) -> None:
    app.command(
        "ui",
        help=("A local web dashboard: the runs (updating live), a run's curves, decisions, fallback chain and log "
              "tail, a batch's report. Serves on 127.0.0.1 only unless --host widens it (then with a token)."),
        epilog=EXAMPLE,
    )(ui_command)


def ui_command(
    port: int = typer.Option(DEFAULT_PORT, "--port", min=0, max=65535, help="Port to serve on (0: any free one).",
                             metavar="PORT"),
    host: str = typer.Option("127.0.0.1", "--host", metavar="ADDRESS",
                             help="Address to serve on. Anything but loopback makes every request need the token "
                                  "printed in the URL."),
    no_refresh: bool = typer.Option(False, "--no-refresh", help="Show the registry as it is: no look at the targets "
                                                                "of active runs, no log read to bring a history up to date."),
    inventory: Optional[Path] = InventoryOpt,
) -> None:
    try:
        import uvicorn

        from ..ui.app import SYNC_EVERY_S, create_app
    except ImportError as exc:
        raise DfoError(f"dfo ui needs its web stack ({exc.name} is not installed)",
                       hint="pip install 'dfo[ui]'") from None
    if inventory is not None:
        load_inventory(inventory)  # a bad file is one line now, not an error page later
    token = None if is_loopback(host) else secrets.token_urlsafe(32)
    sock = bind(host, port)
    previous = signal.signal(signal.SIGTERM, stop_as_ctrl_c)
    try:
        with Store() as store:
            path = store.path
        app = create_app(path, inventory=inventory, token=token, sync_every_s=None if no_refresh else SYNC_EVERY_S)
        sys.stdout.write(url(host, sock.getsockname()[1], token) + "\n")
        sys.stdout.flush()
        say(f"dfo ui: serving the registry {path}; Ctrl-C stops it")
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                               timeout_graceful_shutdown=3))
        try:
            server.run(sockets=[sock])
        finally:
            app.state.close()
    except KeyboardInterrupt:  # uvicorn hands a Ctrl-C or SIGTERM on once it has shut down; one before it started
        # ends here too
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
    say("dfo ui: stopped")


def stop_as_ctrl_c(signum: int, frame: object) -> None:
    """SIGTERM ends `dfo ui` as Ctrl-C does: uvicorn shuts down on it, then raises it again with the handler it
    found, this one (Python's default would end the process silently with 143, no "stopped" line)."""
    raise KeyboardInterrupt


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or one line saying why not and what to do."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host.strip("[]"), port), family=family, backlog=64)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise DfoError(f"cannot serve on {host}:{port}: the port is in use",
                           hint="pick another with --port, or --port 0 for any free one") from None
        raise UsageError(f"cannot serve on {host}:{port}: {exc.strerror or exc}",
                         hint="--host takes an address of this machine, e.g. 127.0.0.1 or 0.0.0.0") from None


def url(host: str, port: int, token: Optional[str]) -> str:
    """The URL to open: the bound address (this machine's name for an all-interfaces bind), the token if any."""
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "[::]") else host
    shown = f"[{shown}]" if ":" in shown and not shown.startswith("[") else shown
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
