"""Telling people about decisions: the inventory's `notify:` (global, or per variant) run for each decision.

- `command:` runs on the workstation (`sh -c`), the decision JSON on stdin and DFO_RUN, DFO_TARGET,
  DFO_VARIANT, DFO_BATCH, DFO_DECISION, DFO_ACTION, DFO_NEXT_RUN, DFO_STEADY_TOK_S, DFO_TEXT in its environment.
- `webhook:` gets the decision JSON POSTed, with a Slack-compatible `text` (Slack, Mattermost, Discord's
  /slack endpoint and most chat bridges show it).

Each (run, decision, channel) is claimed in the registry before it is sent, so it goes out once: never again
after a restart, never twice from two dfo processes watching the same run. Sending happens on a worker thread
with a bounded timeout and bounded retries: a slow or dead receiver never holds up the watch, and a failure
is recorded (registry + an event) and logged, never raised. The worker threads are not daemons, so dfo exits
only once the notifications it started are done (at most timeout x (retries + 1) plus the back-off).

A steady verdict re-declared at a new level after a level shift is a decision of its own (keyed by the
shift), with both levels in its text: steady -> steady at another level is news.

This module must not decide anything: it is told about decisions (Notifier.decision) and passes them on.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import logging
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Iterator, Mapping, Optional
from urllib.parse import unquote, urlsplit, urlunsplit

from .decide import Decision, read_stored
from .events import NotifyFailed, record
from .inventory import Inventory, Notify
from .sanitize import json_line, url_origin
from .states import Verdict
from .store import Store, utc_now

log = logging.getLogger(__name__)
BACKOFF_S = 1.0  # before the first retry; doubled for each further one
QUIET = "undecided"


def declared_shift(decision: Decision) -> dict[str, Any] | None:
    """The level shift whose new level the decision's steady verdict declares (its last shift, once declared)."""
    shifts = decision.level_shifts or []
    if decision.decision != Verdict.STEADY or not shifts or shifts[-1].get("declared_tok_s") is None:
        return None
    return shifts[-1]


def notification_key(decision: Decision) -> str:
    """What makes a decision news to the people told: its verdict and action, and for a steady verdict at a new
    level after a level shift, that shift (steady -> steady at another level is news too)."""
    key = f"{decision.decision}:{decision.action or 'none'}"
    shift = declared_shift(decision)
    return key if shift is None else f"{key}:level_shift@{shift['at_step']}"


def message(decision: Decision, run: dict[str, Any]) -> str:
    """One line for a chat: what was decided about which run, with its figure and what dfo does next."""
    where = f"{run['name']} on {run.get('target') or '?'}" + (f" ({run['variant']})" if run.get("variant") else "")
    at = f" at step {decision.at_step}" if decision.at_step is not None else ""
    figure = f", {decision.steady_tok_s:,.0f} tok/s" if decision.steady_tok_s is not None else ""
    shift = declared_shift(decision)
    if shift is not None and figure:
        figure = (f" at a new level, {shift['from_tok_s']:,.0f} -> {decision.steady_tok_s:,.0f} tok/s (level shift "
                  f"at step {shift['at_step']})")
    signature = f" [{decision.signature}]" if decision.signature else ""
    then = f"; action {decision.action or 'none'}" + (f" -> {decision.next_run}" if decision.next_run else "")
    return f"dfo: {where}: {decision.decision}{signature}{at}{figure}{then}"


class Notifier:
    """Passes decisions to the inventory's notify channels, once each. `Notifier.decision(run, decision)`."""

    def __init__(self, inventory: Inventory, store: Store) -> None:
        self.inventory = inventory
        self.store = store
        self._threads: list[threading.Thread] = []

    def settings_for(self, variant: Optional[str]) -> Optional[Notify]:
        """The variant's notify: when it has one, else the inventory's."""
        chosen = self.inventory.variants.get(variant) if variant else None
        return (chosen.notify if chosen and chosen.notify else None) or self.inventory.notify

    def decision(self, run_name: str, decision: Decision | Mapping[str, Any]) -> list[threading.Thread]:
        """Announce `decision` about `run_name` on every channel that has not announced it yet (returns the
        worker threads started, for tests to join). Its JSON (a stored one, say) is read through the one reader
        of stored decisions (decide.read_stored): one it cannot read is not sent, and is logged."""
        if not isinstance(decision, Decision):
            decision, unreadable = read_stored(decision)
            if unreadable:
                log.warning("not notifying about %s: %s", run_name, unreadable)
        verdict = decision.decision if decision is not None else None
        if not verdict or verdict == QUIET:
            return []
        run = self.store.find_run(run_name)
        variant = run.variant if run else None
        settings = self.settings_for(variant)
        if settings is None or (settings.decisions is not None and verdict not in settings.decisions):
            return []
        about = {"name": run_name, "target": run.target if run else None, "variant": variant,
                 "batch": run.batch if run else None}
        key = notification_key(decision)
        started = []
        for channel, send in (("command", self._command), ("webhook", self._webhook)):
            if getattr(settings, channel) is None or not self.store.claim_notification(run_name, key, channel):
                continue
            worker = threading.Thread(target=self._deliver, args=(channel, send, settings, run_name, key, decision, about),
                                      name=f"dfo-notify-{channel}-{run_name}")
            worker.start()
            started.append(worker)
        self._threads = [t for t in self._threads if t.is_alive()] + started
        return started

    def wait(self, timeout_s: float) -> None:
        """Wait for the notifications under way (bounded): for callers that want them out before they go on."""
        deadline = time.monotonic() + timeout_s
        for worker in self._threads:
            worker.join(max(0.0, deadline - time.monotonic()))

    def _deliver(self, channel: str, send, settings: Notify, run_name: str, key: str, decision: Decision,
                 about: dict) -> None:
        detail = None
        for attempt in range(settings.retries + 1):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                detail = send(settings, decision, about)
            except Exception as exc:  # a notification must never end the watch: every failure is recorded
                detail = f"{type(exc).__name__}: {exc}"
            if detail is None:
                break
            if detail.startswith("permanent: "):
                break
        try:  # on a connection of its own: the watch that asked may have ended and closed its Store meanwhile
            with self._registry() as store:
                store.finish_notification(run_name, key, channel, ok=detail is None, detail=detail)
                if detail is not None:
                    record(store, NotifyFailed(at=utc_now(), run=run_name, channel=channel, key=key, error=detail))
        except Exception as exc:  # the registry cannot be written (its disk): the log line still says it
            log.warning("recording notification of %s failed: %s", run_name, exc)
        if detail is not None:
            log.warning("notify %s of %s (%s) failed: %s", channel, run_name, key, detail)

    @contextlib.contextmanager
    def _registry(self) -> Iterator[Store]:
        """The registry for a worker's result: a connection of its own to the Notifier's file (closed after),
        so a watch that ends (closing its Store) before the send does cannot leave the row claimed and unsent;
        the shared Store for a private in-memory one (tests), which another connection cannot see."""
        if self.store.path == ":memory:":
            yield self.store
            return
        with Store(self.store.path) as own:
            yield own

    def _command(self, settings: Notify, decision: Decision, about: dict) -> Optional[str]:
        """Run the command; None when it exited 0, else why not."""
        text = message(decision, about)
        env = {**os.environ, "DFO_RUN": about["name"], "DFO_TARGET": about["target"] or "",
               "DFO_VARIANT": about["variant"] or "", "DFO_BATCH": about["batch"] or "",
               "DFO_DECISION": str(decision.decision), "DFO_ACTION": str(decision.action or ""),
               "DFO_NEXT_RUN": decision.next_run or "",
               "DFO_STEADY_TOK_S": "" if decision.steady_tok_s is None else str(decision.steady_tok_s),
               "DFO_TEXT": text}
        try:
            done = subprocess.run(["/bin/sh", "-c", settings.command], input=json_line(payload(decision, about)),
                                  capture_output=True, text=True, timeout=settings.timeout_s, env=env,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return f"command did not finish within {settings.timeout_s:g} s"
        if done.returncode == 0:
            return None
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        return f"command exited {done.returncode}: {last[0][:200]}"

    def _webhook(self, settings: Notify, decision: Decision, about: dict) -> Optional[str]:
        """POST the decision; None on a 2xx answer. 4xx (but 408/429) is `permanent: ` (retrying cannot help).
        Credentials in the URL (`https://user:pass@host/...`) go in an Authorization header; what comes back
        names the receiver by url_origin() alone, whatever failed."""
        body = json_line(payload(decision, about)).encode()
        url, headers = _without_credentials(settings.webhook)
        where = url_origin(settings.webhook)
        try:
            request = urllib.request.Request(url, data=body, method="POST", headers={
                "Content-Type": "application/json", "User-Agent": "dfo", **headers})
            with NO_REDIRECTS.open(request, timeout=settings.timeout_s) as answer:
                answer.read(4096)
                return None
        except urllib.error.HTTPError as exc:
            if 300 <= exc.code < 400:
                return (f"permanent: {where} answered HTTP {exc.code} {exc.reason}: a redirect, not followed (set "
                        "notify.webhook to the URL it points to)")
            permanent = 400 <= exc.code < 500 and exc.code not in (408, 429)
            return f"{'permanent: ' if permanent else ''}{where} answered HTTP {exc.code} {exc.reason}"
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            return f"{where}: {_scrubbed(str(getattr(exc, 'reason', exc)), settings.webhook)}"
        except ValueError:  # http.client.InvalidURL and kin quote the URL: never shown
            return f"permanent: {where}: the URL is not valid (fix notify.webhook)"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A webhook's redirect is an answer, not followed: urllib would re-send the request as a GET (its body
    dropped) to wherever the Location points, another host included, with the Authorization header that
    carries the URL's credentials copied."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


NO_REDIRECTS = urllib.request.build_opener(_NoRedirect)


def _without_credentials(url: str) -> tuple[str, dict[str, str]]:
    """The URL without `user:password@`, and the Basic Authorization header that carries them instead."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, {}
    netloc = parts.netloc.rpartition("@")[2]
    pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode()
    return (urlunsplit(parts._replace(netloc=netloc)),
            {"Authorization": "Basic " + base64.b64encode(pair).decode("ascii")})


def _scrubbed(text: str, url: str) -> str:
    """An error text with every secret part of `url` (credentials, path, query) taken out."""
    parts = urlsplit(url)
    secrets = [parts.netloc.rpartition("@")[0], parts.password, parts.path if len(parts.path) > 1 else "",
               parts.query, url]
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "...")
    return text


def payload(decision: Decision, about: dict[str, Any]) -> dict[str, Any]:
    """What both channels send: the decision (docs/design.md shape) plus the run's target/variant/batch and `text`."""
    return {**decision.to_json(), "run": about["name"], "target": about["target"], "variant": about["variant"],
            "batch": about["batch"], "text": message(decision, about)}

