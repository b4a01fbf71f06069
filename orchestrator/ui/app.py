"""The dashboard's ASGI app (Starlette): routes, templates, the token and host checks, security headers.

Pages are rendered on the server with Jinja2, autoescape on: every value a template prints is escaped, so a
log line, a crash reason or a setting reaches the page as text, never as an element or a script. The page's
only script is static/live.js (no inline script; the Content-Security-Policy allows none), which swaps a
section's HTML for a fresh copy from its fragment URL every few seconds: the runs list updates without a
reload.

Access: bound to loopback, only requests naming a loopback host are answered (a DNS-rebound page cannot
read it). Bound wider, every request needs the token `dfo ui` printed in its URL (compared in constant time,
then kept in an HttpOnly cookie; it never appears in a log: uvicorn's access log is off).

This module reaches no machine except for a run's log tail (runs.log_tail over the run's inventory, as `dfo
logs` does, with its timeout).
"""

from __future__ import annotations

import hmac
import re
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlencode

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup, escape
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import runs as runs_lib
from ..connections import Connections
from ..errors import DfoError, UnknownRun, UsageError
from ..names import check_name
from ..sanitize import visible
from ..store import Run, Store
from ..words import counted
from . import is_loopback, pages

COOKIE = "dfo_ui_token"
LOG_LINES = 60
LIVE_RUNS_S = 2  # how often the runs list asks for a fresh copy
LIVE_RUN_S = 5  # a run's page
SYNC_EVERY_S = 5.0  # how often the active runs and the opened ones are brought up to date (Syncer)
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def templates() -> Environment:
    env = Environment(loader=PackageLoader("orchestrator.ui", "templates"), autoescape=True, undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True)
    env.globals.update(NUMERIC=pages.NUMERIC_COLUMNS, LIVE_RUNS_S=LIVE_RUNS_S, LIVE_RUN_S=LIVE_RUN_S)
    env.filters["breakable"] = breakable
    env.filters["counted"] = counted  # {{ n|counted("metric line") }}: `1 metric line`, `3 metric lines`
    return env


def breakable(name: str) -> Markup:
    """A long run or cell name, escaped, that may wrap after its `.`, `_` and `-` (never inside a word)."""
    return Markup("<wbr>").join(escape(part) for part in re.split(r"(?<=[._-])", str(name)))


class LogTails:
    """A run's log tail through the Connections of the inventory it was launched from (kept open while the
    dashboard runs, one per inventory, closed at the end)."""

    def __init__(self, inventory: Optional[Path]) -> None:
        self.inventory = inventory
        self._stack = ExitStack()
        self._opened: dict[str, Connections] = {}
        self._lock = threading.Lock()

    def tail(self, run: Run, lines: int = LOG_LINES) -> str:
        from ..chains import inventory_for

        if not run.log_path:
            raise DfoError(f"{run.name} has no log recorded")
        inv, _ = inventory_for(run, self.inventory)
        with self._lock:
            if inv.source not in self._opened:
                self._opened[inv.source] = self._stack.enter_context(Connections(inv))
            connections = self._opened[inv.source]
        return runs_lib.log_tail(connections.container(run.target), run, lines)

    def close(self) -> None:
        self._stack.close()


class Syncer:
    """What `dfo runs` and `dfo metrics` do before they show anything, done in the background every `every_s`
    while the dashboard runs: the active runs' rows looked at (runs.look_due) and their histories, and those of
    the runs whose page was opened (history.needs_sync), brought up to their logs' end by history.sync_runs,
    the one sync the CLI calls. The pages read what it stored; what it could not reach is said on the list."""

    def __init__(self, store_path: str | Path, inventory: Optional[Path], every_s: float) -> None:
        self.store_path, self.inventory, self.every_s = store_path, inventory, every_s
        self.problems: dict[str, str] = {}
        self._opened: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dfo-ui-sync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def opened(self, name: str) -> None:
        """A page of run `name` was shown: its history is brought up to date too from now on."""
        with self._lock:
            self._opened.add(name)

    def sync_once(self) -> None:
        from ..history import needs_sync, sync_runs

        with self._lock:
            opened = set(self._opened)
        with Store(self.store_path) as store:
            runs = store.list_runs()
            behind = [run for run in runs if runs_lib.look_due(run) or (run.name in opened and needs_sync(run))]
            self.problems = sync_runs(store, runs, self.inventory, history_of=behind) if behind else {}

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except DfoError as exc:  # a registry or inventory it cannot read: said on the list, tried again
                self.problems = {"registry": str(exc)}
            self._stop.wait(self.every_s)

    def close(self) -> None:
        self._stop.set()


class UnknownBatch(UsageError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"no batch named {name!r} in the registry; known batches: {', '.join(known) or 'none yet'}",
                         hint="run `dfo batch FILE` first")


class LoopbackHostOnly:
    """Answers only requests whose Host header names a loopback address (`127.0.0.1:PORT`, `[::1]:PORT`,
    `localhost:PORT`): a DNS-rebound page, whose Host is the attacker's name, gets 400."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not is_loopback(Request(scope).headers.get("host", "")):
            response = HTMLResponse("<!doctype html><title>dfo ui</title><p>Invalid host header.</p>", 400)
            response.headers.update(HEADERS)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class TokenGate:
    """Every request needs `token`: as ?token= (answered with a redirect that drops it from the URL and sets
    the cookie) or as the cookie. Compared in constant time."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        given = request.query_params.get("token")
        if given is not None and hmac.compare_digest(given.encode(), self.token.encode()):
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            response: Response = RedirectResponse(request.url.path + (f"?{urlencode(rest)}" if rest else ""), 303)
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
        elif hmac.compare_digest(request.cookies.get(COOKIE, "").encode(), self.token.encode()):
            await self.app(scope, receive, send)
            return
        else:
            response = HTMLResponse("<!doctype html><title>dfo ui</title><p>This dashboard needs its token: open the "
                                    "URL that <code>dfo ui</code> printed when it started.</p>", 403)
        response.headers.update(HEADERS)
        await response(scope, receive, send)


def create_app(store_path: str | Path, *, inventory: Optional[Path] = None, token: Optional[str] = None,
               clock: Callable[[], float] = time.time, sync_every_s: float | None = SYNC_EVERY_S) -> Starlette:
    """The dashboard over the registry at `store_path`. `token`: required on every request (a widened bind);
    None: loopback only, no token. `sync_every_s`: how often the Syncer runs (None: never, the store as it is)."""
    env = templates()
    tails = LogTails(inventory)
    syncer = Syncer(store_path, inventory, sync_every_s or 0.0)

    def page(template: str, status: int = 200, **values: Any) -> HTMLResponse:
        return HTMLResponse(env.get_template(template).render(**values), status, headers=HEADERS)

    def registry() -> Store:
        return Store(store_path)

    def named(request: Request, kind: str) -> str:
        return check_name(request.path_params["name"], kind)

    def runs_list(request: Request) -> HTMLResponse:
        with registry() as store:
            rows, batches = pages.run_rows(store, clock()), store.batches()
        return page("runs.html", rows=rows, note=pages.runs_note(rows), batches=batches, registry=str(store_path),
                    problems=syncer.problems)

    def runs_fragment(request: Request) -> HTMLResponse:
        with registry() as store:
            rows = pages.run_rows(store, clock())
        return page("_runs_table.html", rows=rows, note=pages.runs_note(rows), problems=syncer.problems)

    def run_view(request: Request) -> HTMLResponse:
        name = named(request, "run name")
        with registry() as store:
            group = pages.group_page(store, name, clock()) if store.find_run(name) is None else None
            if group is not None:
                return page("group.html", view=group)
            view = pages.run_page(store, name, clock())
        syncer.opened(view.run.name)
        return page("run.html", view=view)

    def run_fragment(request: Request) -> HTMLResponse:
        with registry() as store:
            view = pages.run_page(store, named(request, "run name"), clock())
        return page("_run_body.html", view=view)

    def log_fragment(request: Request) -> HTMLResponse:
        with registry() as store:
            run = store.get_run(named(request, "run name"))
        try:
            return page("_log.html", log=visible(tails.tail(run), keep_newlines=True), error=None, run=run)
        except DfoError as exc:
            return page("_log.html", log=None, error=visible(str(exc)), run=run)

    def batch_view(request: Request) -> HTMLResponse:
        name = named(request, "batch name")
        with registry() as store:
            if name not in {batch["name"] for batch in store.batches()}:
                raise UnknownBatch(name, [batch["name"] for batch in store.batches()])
            view = pages.batch_page(store, name)
        return page("batch.html", view=view)

    async def refused(request: Request, exc: Exception) -> HTMLResponse:
        status = 404 if isinstance(exc, (UnknownRun, UnknownBatch)) else 400 if isinstance(exc, UsageError) else 500
        message = exc.message if isinstance(exc, DfoError) else str(exc)
        return page("error.html", status, message=visible(message), hint=visible(getattr(exc, "hint", None) or ""))

    async def not_found(request: Request, exc: Exception) -> HTMLResponse:
        return page("error.html", 404, message=f"no page at {visible(request.url.path)}", hint="")

    static = StaticFiles(packages=[("orchestrator.ui", "static")])
    middleware = [Middleware(TokenGate, token=token) if token else Middleware(LoopbackHostOnly)]
    app = Starlette(
        routes=[
            Route("/", runs_list),
            Route("/fragments/runs", runs_fragment),
            Route("/runs/{name}", run_view),
            Route("/fragments/runs/{name}", run_fragment),
            Route("/fragments/runs/{name}/log", log_fragment),
            Route("/batches/{name}", batch_view),
            Mount("/static", static, name="static"),
        ],
        middleware=middleware,
        exception_handlers={UsageError: refused, DfoError: refused, 404: not_found},
    )
    if sync_every_s is not None:
        syncer.start()

    def close() -> None:
        syncer.close()
        tails.close()

    app.state.close = close
    return app
