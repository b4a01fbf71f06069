"""Notifications of decisions: a webhook against a real HTTP server on 127.0.0.1 and a workstation command,
once per decision (also across a restart: a new Store and Notifier on the same registry), bounded timeouts and
retries with failures recorded and never raised, per-variant settings, and the watcher announcing a real
run's steady verdict exactly once even when it is watched again."""

from __future__ import annotations

import base64
import json
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harness import write_inventory
from orchestrator import notify
from orchestrator.inventory import load_inventory, parse_inventory
from orchestrator.notify import Notifier
from orchestrator.store import Run, Store

STEADY = {"decision": "steady", "run": "r1", "at_step": 412, "steady_tok_s": 153000.0, "interval": [151200.0, 154800.0],
          "action": "keep", "next_run": None, "signature": None}
CRASH = {"decision": "crash", "run": "r1", "at_step": 3, "signature": "cudagraph_tls", "action": "fallback",
         "next_run": "r1.2-nographs", "steady_tok_s": None}


class Receiver:
    """An HTTP server on 127.0.0.1 that records every POST and answers with the next scripted status."""

    def __init__(self, statuses=(), delay_s: float = 0.0, location: str | None = None) -> None:
        self.posts: list[dict] = []
        self.gets: list[dict] = []
        self.statuses = list(statuses)
        self.delay_s = delay_s
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts.append({"path": self.path, "type": self.headers["Content-Type"], "json": json.loads(body),
                                      "raw": body, "auth": self.headers.get("Authorization")})
                time.sleep(receiver.delay_s)
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.end_headers()
                self.wfile.write(b"ok")

            def do_GET(self) -> None:
                receiver.gets.append({"path": self.path, "auth": self.headers.get("Authorization")})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/services/T000/B000/secret"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def make(statuses=(), delay_s=0.0, location=None) -> Receiver:
        made.append(Receiver(statuses, delay_s, location))
        return made[-1]

    yield make
    for server in made:
        server.close()


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(notify, "BACKOFF_S", 0.05)


def inventory_with(notify_yaml: str, variant_notify: str = ""):
    return parse_inventory(textwrap.dedent(f"""
        hosts: {{pve1: {{address: 10.0.0.1, containers: {{ct200: {{ctid: 200}}}}}}}}
        variants:
          trees: {{compile: trees, preset: tiny-cpu{', notify: ' + variant_notify if variant_notify else ''}}}
          nographs: {{compile: nographs, preset: tiny-cpu}}
        notify: {notify_yaml}
    """))


def registry(path: Path, *runs: tuple[str, str]) -> Store:
    store = Store(path)
    for name, variant in runs:
        store.add_run(Run(name=name, target="ct200", variant=variant, batch="sweep", state="running"))
    return store


def send(notifier: Notifier, run: str, decision: dict) -> None:
    for worker in notifier.decision(run, decision):
        worker.join(30)


def test_webhook_gets_the_decision_json_with_a_slack_text_and_the_command_its_stdin_and_env(receiver, tmp_path):
    hook = receiver()
    out = tmp_path / "told"
    command = f"cat > {out}.json; env | grep ^DFO_ | sort > {out}.env"
    inventory = inventory_with(json.dumps({"webhook": hook.url, "command": command}))
    with registry(tmp_path / "dfo.db", ("r1", "trees")) as store:
        send(Notifier(inventory, store), "r1", STEADY)
        assert [(n["channel"], n["ok"]) for n in store.notifications("r1")] == [("command", True), ("webhook", True)]
    [post] = hook.posts
    assert post["path"] == "/services/T000/B000/secret" and post["type"] == "application/json"
    assert post["json"]["decision"] == "steady" and post["json"]["interval"] == [151200.0, 154800.0]
    assert post["json"]["text"] == "dfo: r1 on ct200 (trees): steady at step 412, 153,000 tok/s; action keep"
    assert json.loads(out.with_suffix(".json").read_text())["steady_tok_s"] == 153000.0
    env = dict(line.split("=", 1) for line in out.with_suffix(".env").read_text().splitlines())
    assert (env["DFO_RUN"], env["DFO_DECISION"], env["DFO_ACTION"], env["DFO_VARIANT"], env["DFO_BATCH"]) == (
        "r1", "steady", "keep", "trees", "sweep")
    assert env["DFO_STEADY_TOK_S"] == "153000.0" and env["DFO_TEXT"].startswith("dfo: r1 on ct200")


def test_a_nan_in_the_decision_reaches_webhook_and_command_as_strict_json(receiver, tmp_path):
    def strict(text):  # RFC 8259: no NaN/Infinity (Python's json.loads would take them)
        return json.loads(text, parse_constant=lambda word: pytest.fail(f"not JSON: {word}"))

    hook = receiver()
    out = tmp_path / "told.json"
    inventory = inventory_with(json.dumps({"webhook": hook.url, "command": f"cat > {out}"}))
    crash = {"decision": "crash", "run": "r1", "signature": "nan_loss", "action": "fallback",
             "evidence": {"loss": float("nan"), "tok_s": float("inf")}}
    with registry(tmp_path / "dfo.db", ("r1", "trees")) as store:
        send(Notifier(inventory, store), "r1", crash)
    [post] = hook.posts
    for sent in (strict(post["raw"]), strict(out.read_text())):
        assert sent["evidence"]["loss"] is None and sent["evidence"]["tok_s"] is None
        assert sent["evidence"]["nonfinite"] == {"loss": "NaN", "tok_s": "Infinity"}


def test_each_decision_is_sent_once_even_after_a_restart(receiver, tmp_path):
    hook = receiver()
    inventory = inventory_with(json.dumps({"webhook": hook.url}))
    with registry(tmp_path / "dfo.db", ("r1", "trees")) as store:
        notifier = Notifier(inventory, store)
        send(notifier, "r1", STEADY)
        send(notifier, "r1", STEADY)  # the watcher re-records the same verdict
        send(notifier, "r1", {**STEADY, "decision": "undecided", "action": "none"})  # never announced
    with Store(tmp_path / "dfo.db") as reopened:  # dfo restarted: a new process, the same registry
        send(Notifier(inventory, reopened), "r1", STEADY)
        send(Notifier(inventory, reopened), "r1", CRASH)  # another decision is news
    assert [post["json"]["decision"] for post in hook.posts] == ["steady", "crash"]
    assert "crash [cudagraph_tls] at step 3; action fallback -> r1.2-nographs" in hook.posts[1]["json"]["text"]


def test_a_steady_verdict_at_a_new_level_after_a_declared_level_shift_is_news_with_both_levels(receiver, tmp_path):
    """steady -> steady at another level (a 29% drop) notifies like a verdict change, once, with
    both levels in the text; the shift while its new level is not declared (undecided) tells no one."""
    hook = receiver()
    shift = {"at_step": 1861, "detected_step": 1920, "from_tok_s": 56754.5, "to_tok_s": 40591.0, "declared_tok_s": None,
             "declared_step": None}
    reopened = {**STEADY, "decision": "undecided", "action": "none", "steady_tok_s": None, "level_shifts": [shift]}
    declared = {**STEADY, "at_step": 2700, "steady_tok_s": 40296.1,
                "level_shifts": [{**shift, "declared_tok_s": 40296.1, "declared_step": 2700}]}
    inventory = inventory_with(json.dumps({"webhook": hook.url}))
    with registry(tmp_path / "dfo.db", ("r1", "trees")) as store:
        notifier = Notifier(inventory, store)
        for decision in (STEADY, reopened, declared, declared):
            send(notifier, "r1", decision)
    with Store(tmp_path / "dfo.db") as reopened_store:  # a restart does not send it again
        send(Notifier(inventory, reopened_store), "r1", declared)
    assert [(p["json"]["decision"], p["json"]["steady_tok_s"]) for p in hook.posts] == [
        ("steady", 153000.0), ("steady", 40296.1)]
    assert hook.posts[1]["json"]["text"] == (
        "dfo: r1 on ct200 (trees): steady at step 2700 at a new level, 56,754 -> 40,296 tok/s (level shift at step "
        "1861); action keep")
    assert hook.posts[1]["json"]["level_shifts"][0]["from_tok_s"] == 56754.5


def test_failures_are_retried_within_bounds_recorded_and_never_raised(receiver, tmp_path):
    flaky = receiver(statuses=[503, 200])  # a retry gets through
    broken = receiver(statuses=[500, 500, 500, 500])
    wrong = receiver(statuses=[404])  # a wrong URL: retrying cannot help
    with registry(tmp_path / "dfo.db", ("a", "trees"), ("b", "trees"), ("c", "trees")) as store:
        for run, hook in (("a", flaky), ("b", broken), ("c", wrong)):
            send(Notifier(inventory_with(json.dumps({"webhook": hook.url, "retries": 2})), store), run, STEADY)
        results = {n["run"]: (n["ok"], n["detail"]) for n in store.notifications()}
        failed_events = store.events("b", kind="notify_failed")
    assert (len(flaky.posts), len(broken.posts), len(wrong.posts)) == (2, 3, 1)
    assert results["a"] == (True, None)
    assert results["b"][0] is False and "answered HTTP 500" in results["b"][1] and "secret" not in results["b"][1]
    assert results["c"][0] is False and "HTTP 404" in results["c"][1]
    assert failed_events and failed_events[0]["data"]["channel"] == "webhook"


def test_a_webhook_with_credentials_sends_them_as_basic_auth_and_shows_only_its_scheme_and_host(receiver, tmp_path,
                                                                                                caplog):
    """`https://user:PASS@host/...` with a failing receiver: the credentials reach the receiver (Authorization
    header), and nothing of them or of the secret path is in stderr, notifications.detail or the event."""
    hook = receiver(statuses=[500])
    origin = hook.url.split("/services")[0]
    url = hook.url.replace("http://", "http://hook-user:PASS%40word@")
    with registry(tmp_path / "dfo.db", ("r1", "trees")) as store:
        send(Notifier(inventory_with(json.dumps({"webhook": url, "retries": 0})), store), "r1", STEADY)
        [told] = store.notifications("r1")
        [event] = store.events("r1", kind="notify_failed")
    [post] = hook.posts
    assert post["path"] == "/services/T000/B000/secret"
    assert post["auth"] == "Basic " + base64.b64encode(b"hook-user:PASS@word").decode()
    assert told["ok"] is False and told["detail"] == f"{origin} answered HTTP 500 Internal Server Error"
    shown = told["detail"] + json.dumps(event["data"]) + caplog.text
    assert origin in caplog.text
    for secret in ("PASS", "hook-user", "secret", "T000"):
        assert secret not in shown


@pytest.mark.parametrize("status", [301, 302, 303])
def test_a_webhook_that_redirects_is_not_followed_and_its_credentials_reach_no_other_host(receiver, tmp_path, status):
    """urllib followed a receiver's 30x as a GET (the decision dropped) to wherever its Location pointed, another
    host included, with the Authorization header (the URL's credentials) copied."""
    elsewhere = receiver()
    hook = receiver(statuses=[status], location=elsewhere.url.replace("/services", "/collect"))
    origin = hook.url.split("/services")[0]
    url = hook.url.replace("http://", "http://hook-user:PASS@")
    with registry(tmp_path / "dfo.db", ("r1", "trees")) as store:
        send(Notifier(inventory_with(json.dumps({"webhook": url, "retries": 2})), store), "r1", STEADY)
        [told] = store.notifications("r1")
    assert len(hook.posts) == 1  # a redirect is permanent: not retried
    assert elsewhere.gets == [] and elsewhere.posts == []
    assert told["ok"] is False and told["detail"].startswith(f"permanent: {origin} answered HTTP {status} ")
    assert told["detail"].endswith("a redirect, not followed (set notify.webhook to the URL it points to)")
    assert "collect" not in told["detail"]


def test_a_webhook_url_with_a_control_character_is_refused_at_load_without_showing_its_path():
    from orchestrator.errors import InventoryError

    with pytest.raises(InventoryError) as info:
        inventory_with(json.dumps({"webhook": "https://hooks.example.com/services/T0/B0/SECRET\x01key"}))
    assert info.value.problems == [
        "<memory>: notify.webhook: expected an http:// or https:// URL without spaces or control characters, got one "
        "for https://hooks.example.com that has them (its path is not shown: it may hold a secret)"]


def test_a_hung_receiver_or_a_closed_port_costs_a_bounded_time_off_the_watch(receiver, tmp_path):
    hung = receiver(delay_s=10)
    with registry(tmp_path / "dfo.db", ("a", "trees"), ("b", "trees")) as store:
        notifier = Notifier(inventory_with(json.dumps({"webhook": hung.url, "timeout_s": 1.0, "retries": 1})), store)
        started = time.monotonic()
        workers = notifier.decision("a", STEADY)
        assert time.monotonic() - started < 1.5  # the caller (the watch loop) is not held up (2 x 1 s if it were)
        for worker in workers:
            worker.join(10)
        assert time.monotonic() - started < 6.0  # 2 x 1 s + back-off, not 2 x the receiver's 10 s
        closed = Notifier(inventory_with('{webhook: "http://127.0.0.1:9/x", retries: 0}'), store)
        send(closed, "b", STEADY)
        results = {n["run"]: n for n in store.notifications()}
    assert results["a"]["ok"] is False and "timed out" in results["a"]["detail"]
    assert results["b"]["ok"] is False and "refused" in results["b"]["detail"].lower()


def test_a_variant_notify_replaces_the_global_one_and_filters_decisions(receiver, tmp_path):
    everything, crashes_only = receiver(), receiver()
    inventory = inventory_with(json.dumps({"webhook": everything.url}),
                               variant_notify=json.dumps({"webhook": crashes_only.url, "decisions": ["crash"]}))
    with registry(tmp_path / "dfo.db", ("t", "trees"), ("n", "nographs")) as store:
        notifier = Notifier(inventory, store)
        for run in ("t", "n"):
            send(notifier, run, STEADY)
            send(notifier, run, CRASH)
    assert [p["json"]["run"] + ":" + p["json"]["decision"] for p in crashes_only.posts] == ["t:crash"]
    assert [p["json"]["run"] + ":" + p["json"]["decision"] for p in everything.posts] == ["n:steady", "n:crash"]


def test_notify_settings_are_checked_with_the_inventory():
    from orchestrator.errors import InventoryError

    with pytest.raises(InventoryError) as info:
        inventory_with('{webhook: "slack.com/hook", decisions: [crashed]}')
    assert info.value.problems == [
        "<memory>: notify.webhook: expected an http:// or https:// URL, got 'slack.com/hook'",
        "<memory>: notify.decisions.0: expected 'steady', 'drifting', 'crash', 'stall', 'too_slow', 'stopped' or "
        "'exited', got 'crashed' (did you mean 'crash'?)"]


def test_the_watcher_announces_a_real_runs_verdict_once_across_two_watches(receiver, tmp_path, monkeypatch, pct_env):
    from test_watch import FAST_WATCH, run_until, write_trainers

    from orchestrator.connections import Connections
    from orchestrator.runs import launch, spec_for, stop
    from orchestrator.watch import Watcher

    hook = receiver()
    commands = write_trainers(tmp_path / "scripts")
    path = write_inventory(tmp_path, {
        "defaults": {"workspace": str(tmp_path / "ws")},
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
        "variants": {"nographs": {"command": commands["nographs"]}},
        "watch": FAST_WATCH, "notify": {"webhook": hook.url},
    })
    inventory = load_inventory(path)
    with Connections(inventory) as connections, Store(tmp_path / "dfo.db") as store:
        launch(connections.container("here"), spec_for(inventory, "here", "nographs"), store, name="s1")
        try:
            for _ in range(2):  # the second watch re-judges the stored samples and reaches the same verdict
                watcher = Watcher(inventory, connections, store)
                try:
                    watcher.attach("s1")
                    run_until(watcher, Watcher.settled, timeout=40)
                    watcher.notifier.wait(10)
                finally:
                    watcher.close()
        finally:
            stop(connections.container("here"), store, "s1", grace_s=2)
    assert [post["json"]["decision"] for post in hook.posts] == ["steady"]
    assert hook.posts[0]["json"]["text"].startswith("dfo: s1 on here (nographs): steady at step")


def test_a_notification_failing_after_the_watch_closed_its_registry_is_still_recorded(receiver, tmp_path):
    slow_and_broken = receiver(statuses=[500, 500], delay_s=0.5)
    store = registry(tmp_path / "dfo.db", ("a", "trees"))
    notifier = Notifier(inventory_with(json.dumps({"webhook": slow_and_broken.url, "retries": 1})), store)
    workers = notifier.decision("a", STEADY)
    store.close()  # the watch ended (its `with Store()` closed) while the webhook was still being tried
    for worker in workers:
        worker.join(30)
    with Store(tmp_path / "dfo.db") as reopened:
        [row] = reopened.notifications("a")
        failed = reopened.events("a", kind="notify_failed")
    assert row["ok"] is False and "answered HTTP 500" in row["detail"]  # finished, not left claimed forever
    assert len(slow_and_broken.posts) == 2 and failed and failed[0]["data"]["channel"] == "webhook"


def test_a_decision_json_of_a_shape_this_dfo_does_not_write_is_not_sent_nor_claimed(receiver, tmp_path):
    # the Notifier read decisions by string: a damaged one (a figure that is text) was claimed and sent on, and
    # failed in the worker (`Unknown format code`), recorded as a failed notification; it is read through
    # decide.read_stored now, and one it cannot read tells no one
    hook = receiver()
    inventory = inventory_with(json.dumps({"webhook": hook.url}))
    with registry(tmp_path / "dfo.db", ("r1", "trees")) as store:
        send(Notifier(inventory, store), "r1", {**STEADY, "steady_tok_s": "fast"})
        assert store.notifications("r1") == [] and hook.posts == []
        send(Notifier(inventory, store), "r1", STEADY)  # the readable one still goes out
        assert [(n["channel"], n["ok"]) for n in store.notifications("r1")] == [("webhook", True)]


def test_a_steady_verdict_at_a_new_level_carries_the_level_declared_however_the_watch_read_the_log(receiver, tmp_path):
    """tests/data/probe/late_drop-0.log (steady at ~97.7k from step 255; -14% at step ~615, its new level
    declared at step 715) reaches a watch in the chunks its reads happen to return: a loaded machine reads
    the lines after the declaration in the same chunk. Each notification carries the figure as it stood when its
    verdict was reached, the one the registry records (the level_shift event's declared_tok_s, the decision
    stored) and `dfo replay --timeline` says, whatever the chunks: before, it was the figure refined over
    whatever lines shared the declaration's chunk (83,595 when the whole rest of the log came at once)."""
    from orchestrator.connections import Connections
    from orchestrator.decide import replay_timeline
    from orchestrator.logfmt import format_ts, parse_ts
    from orchestrator.observe import Observation
    from orchestrator.watch import Watcher

    log = (Path(__file__).parent / "data" / "probe" / "late_drop-0.log").read_text().splitlines()
    moved = 1.8e9 - parse_ts(log[0].split()[0][3:])  # its clock in the future: the watch's real ticks say nothing
    lines = [f"ts={format_ts(parse_ts(line.split()[0][3:]) + moved)} {line.split(' ', 1)[1]}" for line in log]
    [*_, first_steady, _undecided, new_level, _final] = replay_timeline(lines)
    split = next(i for i, line in enumerate(lines) if " step=400 " in line) + 1  # after the first steady verdict

    def watched(chunks: list[list[str]], name: str) -> tuple[list[dict], dict, list[dict]]:
        hook = receiver()
        (tmp_path / name).mkdir()
        inventory = load_inventory(write_inventory(tmp_path / name, {
            "defaults": {"workspace": str(tmp_path / name / "ws")},
            "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
            "variants": {"v": {"command": "true"}}, "fallback": [], "notify": {"webhook": hook.url}}))
        with Connections(inventory) as connections, Store(tmp_path / name / "dfo.db") as store:
            store.add_run(Run(name=name, target="here", variant="v", state="running",
                              log_path=str(tmp_path / name / "never.log")))
            watcher = Watcher(inventory, connections, store, fallback=False)
            try:
                watcher.attach(name)
                for index, chunk in enumerate(chunks):
                    watcher.queue.put(Observation("here", "lines", name, lines=tuple(chunk), offset=index + 1,
                                                  data={"ident": {"dev": 1, "ino": 1}}, at=1.8e9))
                    watcher.step(0.01)
                watcher.notifier.wait(10)
            finally:
                watcher.close()
            shifts = [e["data"] for e in store.events(name, kind="level_shift")]
            return [p["json"] for p in hook.posts], store.get_run(name).decision, shifts

    at_once, decision, shifts = watched([lines[:split], lines[split:]], "r1")  # the rest of the log in one read
    assert [p["steady_tok_s"] for p in at_once] == [first_steady.steady_tok_s, new_level.steady_tok_s]
    declared = [s for s in shifts if s["declared"]][-1]["declared_tok_s"]
    assert at_once[1]["steady_tok_s"] == pytest.approx(declared, abs=0.05) == decision["steady_tok_s"]
    assert decision["level_shifts"][-1]["declared_tok_s"] == declared and at_once[1]["at_step"] == 715
    assert f"-> {declared:,.0f} tok/s (level shift at step " in at_once[1]["text"]
    line_by_line, _, _ = watched([[line] for line in lines], "r2")
    assert [p["text"].replace("r2", "r1") for p in line_by_line] == [p["text"] for p in at_once]
