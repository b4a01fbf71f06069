"""`dfo ui` in a real browser: Debian's chromium driven by Playwright, against a real `dfo ui` process over a
real registry (runs recorded through the store API the watcher uses, and one launched on the local target
`here` through `dfo launch`). The pages agree with `dfo runs --json`, `dfo metrics` and `dfo report`; the
runs list updates in place; remote text stays text; a widened bind needs its token."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from harness import cli

from orchestrator.batch import CellTable
from orchestrator.experiments import parse_experiments
from orchestrator.inventory import parse_inventory
from orchestrator.logfmt import format_ts
from orchestrator.store import Run, Store

playwright_api = pytest.importorskip("playwright.sync_api", reason="the dev extra installs playwright")

DFO = str(Path(sys.executable).parent / "dfo")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
T0 = time.time() - 600
WAIT_MS = 20_000  # what a page is given to show a change (the runs list asks every 2 s)

pytestmark = pytest.mark.slow


def environment(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DFO_INVENTORY", "XDG_STATE_HOME")}
    return {**env, **home_env(home)}


def home_env(home: Path) -> dict[str, str]:
    return {"DFO_HOME": str(home / "state"), "HOME": str(home), "COLUMNS": "200"}


def dfo(home: Path, *args: str) -> cli.Ran:
    """`dfo ARGS` in this process (harness.cli) with `home`'s registry."""
    return cli.dfo(*args, env={**home_env(home), "XDG_STATE_HOME": None})


def registry(home: Path) -> Store:
    return Store(home / "state" / "dfo.db")


class Served:
    """A `dfo ui` process and the URL it printed first."""

    def __init__(self, home: Path, *args: str) -> None:
        self.process = subprocess.Popen([DFO, "ui", "--port", "0", *args], env=environment(home), text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout=60):
            self.process.kill()
            raise AssertionError(f"dfo ui printed no URL within 60 s: {self.process.communicate()}")
        self.first_line = self.process.stdout.readline().rstrip("\n")
        self.url = self.first_line.split("?")[0].rstrip("/")
        self.port = int(self.url.rsplit(":", 1)[1])

    def interrupt(self) -> tuple[int, str, str]:
        """Ctrl-C, as a terminal sends it; (exit status, rest of stdout, stderr)."""
        self.process.send_signal(signal.SIGINT)
        out, err = self.process.communicate(timeout=30)
        return self.process.returncode, out, err


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    yield context.new_page()
    context.close()


def add_run(store: Store, name: str, variant: str, level: float, decision: dict | None, *, state: str = "stopped",
            exit_code: int | None = 143, parent: str | None = None, batch: str | None = None, sets: dict | None = None):
    """100 s of a run as the watcher stores it: 20 s of warm-up at a tenth of `level`, then `level`; GPU samples
    of two GPUs every 5 s; a running `undecided`, then its decision."""
    store.add_run(Run(name=name, target="ct200", variant=variant, state=state, exit_code=exit_code, parent=parent,
                      batch=batch, started_at=format_ts(T0), ended_at=format_ts(T0 + 100) if exit_code is not None else None,
                      decision=decision))
    store.add_event(name, "started", {"pid": 1, "target": "ct200", "variant": variant, "sets": sets or {}},
                    at=format_ts(T0))
    store.add_samples(name, [{"step": 10 * k, "ts": T0 + 5 + k, "tok_s": level / 10 if k < 20 else level + (k % 3),
                              "loss": 3.0 - k / 50} for k in range(90)])
    for t in range(0, 100, 5):
        store.add_gpu_samples("ct200", [{"ts": T0 + t, "index": i, "mem_used_mib": 1000.0 * t + i,
                                         "mem_total_mib": 143771.0, "util_pct": 90.0 - i} for i in range(2)], run=name)
    store.add_event(name, "decision", {"chain": name, "decision": {"decision": "undecided", "action": "none"}},
                    at=format_ts(T0 + 30))
    if decision:
        store.add_event(name, "decision", {"chain": name, "decision": decision}, at=format_ts(T0 + 60))


def steady(tok_s: float, **more) -> dict:
    return {"decision": "steady", "action": "keep", "steady_tok_s": tok_s, "interval": [tok_s * 0.98, tok_s * 1.02],
            "warmup_end_step": 200, "at_step": 550, "noisy": False, **more}


SWEEP_INVENTORY = ("hosts:\n  pve1: {address: 10.0.0.1, containers: {ct200: {ctid: 200}}}\n"
                   "variants:\n  trees: {compile: trees, preset: tiny-cpu}\n  nographs: {compile: nographs, preset: tiny-cpu}\n")


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One registry for the module: a crash that fell back to a steady run, a running undecided one, and a
    batch of two cells (one steady, one stopped before it settled)."""
    home = tmp_path_factory.mktemp("ui")
    with registry(home) as store:
        add_run(store, "trees-run", "trees", 900.0, {**steady(900.0), "decision": "crash", "action": "fallback",
                                                     "steady_tok_s": None, "interval": None, "signature": "cudagraph_tls"},
                state="crashed", exit_code=1)
        add_run(store, "trees-run.2-nographs", "nographs", 1234.5, steady(1234.5), parent="trees-run",
                sets={"batch_size": 8})
        add_run(store, "eager-undecided", "eager", 777.0, {"decision": "undecided", "action": "none"},
                state="running", exit_code=None)
        plan = parse_experiments("batch: sweep\ntargets: [ct200]\nmatrix: {variant: [trees, nographs]}\n",
                                 parse_inventory(SWEEP_INVENTORY))
        table = CellTable(store)
        table.save_plan(plan, format_ts(T0))
        add_run(store, "sweep.trees.ct200.r1", "trees", 900.0, steady(900.0), batch="sweep")
        add_run(store, "sweep.nographs.ct200.r1", "nographs", 650.0, {"decision": "stopped", "action": "none"},
                batch="sweep")
        for cell in ("trees.ct200.r1", "nographs.ct200.r1"):
            table.update("sweep", cell, state="done", root_run=f"sweep.{cell}", gpu_ids=[0, 1], outcome={"why": "x"})
        for rank, level in enumerate((500.0, 510.0)):  # a multi-node run: a row per node, none of its own
            add_run(store, f"mn.node{rank}", "ps-trees-2n", level, steady(level))
        store.add_nodes("mn", ["mn.node0", "mn.node1"], "10.0.0.1:29500")
    return home


@pytest.fixture(scope="module")
def served(home):
    """One `dfo ui` over that registry for the tests that only look: the registry as recorded (its runs' target
    is no machine here), as `dfo runs --no-refresh` shows it."""
    server = Served(home, "--no-refresh")
    yield server
    if server.process.poll() is None:
        server.interrupt()


def rows_of(page) -> dict[str, dict[str, str]]:
    """The runs list as shown: run name -> {column class: text}."""
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll("table.runs tbody tr")].map(tr =>
        [tr.dataset.run, Object.fromEntries([...tr.cells].map(td => [td.className.split(" ")[0], td.innerText]))]))""")


def test_the_runs_list_agrees_with_dfo_runs_json(home, served, page):
    page.goto(served.url + "/")
    shown = rows_of(page)
    runs = json.loads(dfo(home, "runs", "--json", "--no-refresh").stdout)
    assert sorted(shown) == sorted(run["name"] for run in runs)
    for run in runs:
        row, decision = shown[run["name"]], run["decision"] or {}
        state = run["state"] if run["exit_code"] is None else f"{run['state']} {run['exit_code']}"
        assert (row["state"], row["verdict"], row["target"], row["variant"]) == (
            state, decision.get("decision", ""), run["target"], run["variant"])
        if decision.get("steady_tok_s") is not None:
            low, high = decision["interval"]
            assert (row["num"], row["basis"], row["interval"]) == (
                f"{decision['steady_tok_s']:,.0f}", "steady", f"95% {low:,.0f}..{high:,.0f}")
    assert shown["trees-run.2-nographs"]["num"] == "1,234"  # f"{1234.5:,.0f}": what `dfo runs NAME` prints too
    assert shown["eager-undecided"]["basis"] == "last-win"  # its figure is the last-window median, said so
    assert "not a steady figure" in page.inner_text("#runs")


def test_the_runs_list_updates_in_place_when_a_verdict_changes(home, served, page):
    page.goto(served.url + "/")
    page.evaluate("window.notReloaded = true")
    row = page.locator('tr[data-run="eager-undecided"]')
    playwright_api.expect(row.locator("td.verdict")).to_have_text("undecided")
    with registry(home) as store:  # as the watcher records a verdict: the run's decision, then its event
        store.update_run("eager-undecided", decision=steady(777.0))
        store.add_event("eager-undecided", "decision", {"chain": "eager-undecided", "decision": steady(777.0)})
    playwright_api.expect(row.locator("td.verdict")).to_have_text("steady", timeout=WAIT_MS)
    playwright_api.expect(row.locator("td.basis")).to_have_text("steady")
    assert row.locator("td.interval").inner_text() == "95% 761..793"
    with registry(home) as store:
        store.update_run("eager-undecided", state="stopped", exit_code=143, ended_at=format_ts(time.time()))
    playwright_api.expect(row.locator("td.state")).to_have_text("stopped 143", timeout=WAIT_MS)
    assert page.evaluate("window.notReloaded") is True  # the list was swapped in, the page never reloaded


def test_a_run_page_shows_its_curves_verdict_chain_and_the_figure_dfo_metrics_prints(home, served, page):
    page.goto(served.url + "/runs/trees-run.2-nographs")
    shown = cli.dfo_process("metrics", "trees-run.2-nographs", env=home_env(home))  # a process: 200 columns, no wrap
    figure_line = next(line for line in shown.stdout.splitlines()
                       if line.startswith("figure: "))
    assert page.inner_text("dd.figure") == figure_line.removeprefix("figure: ")
    assert page.inner_text("dd.verdict") == "steady"
    throughput = page.locator('svg[aria-label="throughput"]')
    assert throughput.locator("polyline.series").count() == 1
    points = throughput.locator("polyline.series").get_attribute("points").split()
    assert len(points) == 90  # every stored step is drawn
    assert throughput.locator("rect.band").count() == 1  # the 95% interval
    labels = throughput.locator("text.mark-label").all_text_contents()
    assert "warm-up ends (step 200)" in labels and "steady -> keep" in labels  # the watcher's "undecided" is no mark
    assert page.locator('svg[aria-label="GPU memory per GPU"] polyline.series').count() == 2  # one line per GPU
    assert page.locator('svg[aria-label="GPU utilisation per GPU"] polyline.series').count() == 2
    gpus = json.loads(dfo(home, "metrics", "trees-run.2-nographs", "--json").stdout)["gpus"]
    cells = page.locator("table.gpus tbody tr").all_inner_texts()
    assert [c.split("\t")[:2] for c in cells] == [[f"GPU {g['index']}", f"{g['peak_mem_mib']:,.0f}"] for g in gpus]
    chain = page.locator("ol.chain li").all_inner_texts()
    assert chain[0].startswith("trees-run trees crashed 1, crash") and chain[1].startswith("trees-run.2-nographs")
    assert "batch_size=8" in page.inner_text("dl.facts")
    page.click("ol.chain li >> text=trees-run")
    playwright_api.expect(page.locator("dd.verdict")).to_have_text("crash")


def test_a_run_page_counts_its_metric_lines_with_the_noun_in_their_number(tmp_path):
    with registry(tmp_path) as store:
        store.add_run(Run(name="one-line", target="ct200", variant="trees", state="stopped", exit_code=143,
                          started_at=format_ts(T0), ended_at=format_ts(T0 + 10)))
        store.add_samples("one-line", [{"step": 10, "ts": T0 + 5, "tok_s": 900.0, "loss": 3.0}])
    server = Served(tmp_path, "--no-refresh")
    try:
        status, _, body = fetch(server.url + "/runs/one-line")
    finally:
        server.interrupt()
    assert status == 200 and "<dd>1 metric line, up to step 10</dd>" in body  # it said "1 metric lines"


def test_a_batch_page_shows_the_figures_and_best_line_of_dfo_report(home, served, page):
    page.goto(served.url + "/batches/sweep")
    report = dfo(home, "report", "sweep")
    data = json.loads(dfo(home, "report", "sweep", "--json").stdout)
    shown = {tr.get_attribute("data-cell"): tr for tr in page.locator("table.report tbody tr").all()}
    assert list(shown) == [cell["cell"] for cell in data["cells"]]
    for cell in data["cells"]:
        tok_s = shown[cell["cell"]].locator('td[data-column="tok/s"]').inner_text()
        assert tok_s == f"{cell['tok_s']:,.0f}"
        assert tok_s in next(line for line in report.stdout.splitlines() if cell["cell"] in line)
    assert shown["nographs.ct200.r1"].locator('td[data-column="basis"]').inner_text() == "last-win"
    best = [line for line in report.stdout.splitlines() if line.startswith("best on")]
    assert page.locator("ul.best li").all_inner_texts() == best == ["best on ct200: trees at 900 tok/s (steady, mean of 1)"]
    assert page.locator("svg.chart polyline.series").count() == 2
    page.click("text=nographs.ct200.r1")
    playwright_api.expect(page.locator("dd.verdict")).to_have_text("stopped")


def test_a_multi_node_runs_page_lists_its_nodes_with_the_line_dfo_runs_ends_with(home, served, page):
    page.goto(served.url + "/runs/mn")
    assert page.inner_text("p.summary") == dfo(home, "runs", "mn", "--no-refresh").stdout.strip().splitlines()[-1]
    assert sorted(rows_of(page)) == ["mn.node0", "mn.node1"]
    page.click("text=mn.node1")
    playwright_api.expect(page.locator("dd.figure")).to_contain_text("steady 510 tok/s")
    page.click('dl.facts a >> text="mn"')
    playwright_api.expect(page.locator("p.summary")).to_be_visible()


HOSTILE = ['<script>window.pwned = "script"</script>', '<img src=x onerror="window.pwned = \'img\'">',
           "</pre><b id=injected>bold</b>"]
STEPS = [f"ts=2026-12-03T10:00:0{k}.000Z event=step step={10 * k} tok_s={1000 + k}.0 loss=2.5" for k in range(1, 4)]


def test_an_unwatched_runs_history_is_synced_and_its_log_and_crash_reason_reach_the_page_as_text(tmp_path, page):
    """A run launched on `here` and never watched, whose log carries markup among its metric lines: `dfo ui`
    brings its row and history up to date (history.sync_runs, as `dfo metrics` does) and shows the markup, and a
    crash reason that carries some, as the characters they are, none of it an element or a script."""
    printed = " ".join("'" + line.replace("'", "'\"'\"'") + "'" for line in HOSTILE + STEPS)
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(json.dumps({
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None, "gpus": [],
                                                                          "workspace": str(tmp_path / "ws")}}}},
        "variants": {"hostile": {"command": f"printf '%s\\n' {printed}; exit 3"}}}))
    launched = dfo(tmp_path, "launch", "--host", "here", "--variant", "hostile", "-i", str(inventory), "--no-preflight",
                   "--name", "hostile-run", "--json")
    assert launched.returncode == 0, launched.stderr
    log = Path(json.loads(launched.stdout)["log"])
    deadline = time.monotonic() + 60
    while not Path(f"{log}.exit").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    with registry(tmp_path) as store:  # the crash reason a watch would quote from such a log; no step stored yet
        store.update_run("hostile-run", decision={"decision": "crash", "action": "stop", "reason": HOSTILE[1]})
        assert store.samples("hostile-run") == [] and store.get_run("hostile-run").state == "running"
    server = Served(tmp_path, "-i", str(inventory))
    try:
        page.goto(server.url + "/runs/hostile-run")
        playwright_api.expect(page.locator("pre.log")).to_contain_text(HOSTILE[0], timeout=WAIT_MS)
        assert page.inner_text("pre.log").splitlines() == HOSTILE + STEPS
        playwright_api.expect(page.locator("dd.state")).to_have_text("crashed 3", timeout=WAIT_MS)
        playwright_api.expect(page.locator("dl.facts")).to_contain_text("3 metric lines, up to step 30", timeout=WAIT_MS)
        assert len(page.locator('svg[aria-label="throughput"] polyline.series').get_attribute("points").split()) == 3
        assert page.inner_text("dd.reason") == HOSTILE[1]
        assert page.evaluate("window.pwned") is None
        assert page.locator("main script, main img, #injected").count() == 0
        page.goto(server.url + "/")
        assert page.locator('tr[data-run="hostile-run"] td.verdict').inner_text() == "crash"
        assert page.evaluate("window.pwned") is None and page.locator("main img").count() == 0
    finally:
        server.interrupt()
    with registry(tmp_path) as store:  # what the page showed is what `dfo metrics` now reads
        assert [s["tok_s"] for s in store.samples("hostile-run")] == [1001.0, 1002.0, 1003.0]


def fetch(url: str, headers: dict | None = None) -> tuple[int, dict, str]:
    """(status, headers, body) of one GET, redirects not followed."""
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


def test_a_widened_bind_answers_only_with_the_token_it_printed_and_never_logs_it(home):
    server = Served(home, "--host", "0.0.0.0")
    try:
        token = server.first_line.split("?token=")[1]
        assert len(token) >= 40
        base = f"http://127.0.0.1:{server.port}"
        assert fetch(base + "/")[0] == 403
        assert fetch(base + "/?token=" + token[:-1] + "x")[0] == 403
        status, headers, _ = fetch(f"{base}/runs/trees-run?token={token}")
        assert status == 303 and headers["location"] == "/runs/trees-run"  # the token leaves the address bar
        cookie = headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie
        status, headers, body = fetch(base + "/runs/trees-run", {"Cookie": cookie.split(";")[0]})
        assert status == 200 and "trees-run" in body and "script-src 'self'" in headers["content-security-policy"]
        assert fetch(base + "/runs/trees-run", {"Cookie": "dfo_ui_token=nope"})[0] == 403
    finally:
        code, out, err = server.interrupt()
    assert code == 0 and token not in out + err


def listening_addresses(port: int) -> set[str]:
    """The addresses a socket of this machine listens on at `port` (/proc/net/tcp and tcp6, state 0A)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]) if len(address) == 8 else address)
    return found


def test_loopback_only_by_default_and_a_foreign_host_name_is_refused(home, served):
    assert served.url.startswith("http://127.0.0.1:") and "token" not in served.first_line
    assert listening_addresses(served.port) == {"127.0.0.1"}
    assert fetch(served.url + "/", {"Host": "attacker.example"})[0] == 400  # a DNS-rebound page gets nothing
    status, _, body = fetch(served.url + "/runs/no-such-run")
    assert status == 404 and "no-such-run" in body and "dfo runs" in body


def test_ctrl_c_stops_it_cleanly_and_frees_the_port(home):
    server = Served(home)
    assert fetch(server.url + "/")[0] == 200
    code, _, err = server.interrupt()
    assert code == 0 and err.strip().splitlines()[-1] == "dfo ui: stopped"
    socket.create_server(("127.0.0.1", server.port)).close()  # the port is free again


def test_sigterm_stops_it_as_ctrl_c_does_with_its_stopped_line_and_exit_0(home):
    """SIGTERM (systemd, `kill`, a container's stop) ended it silently with 143: uvicorn raises the signal again
    after its shutdown, and Python's default handler for it prints nothing."""
    server = Served(home)
    assert fetch(server.url + "/")[0] == 200
    server.process.send_signal(signal.SIGTERM)
    _, err = server.process.communicate(timeout=30)
    assert server.process.returncode == 0 and err.strip().splitlines()[-1] == "dfo ui: stopped"
    socket.create_server(("127.0.0.1", server.port)).close()


def test_an_ipv6_loopback_bind_serves_its_pages_and_still_refuses_a_foreign_host_name(home):
    """`dfo ui --host ::1` answered every request with 400: Starlette's host check before its fix (the ui
    extra's floor is 0.37) cut the Host header `[::1]:PORT` at its first colon."""
    server = Served(home, "--host", "::1")
    try:
        assert server.url.startswith("http://[::1]:") and "token" not in server.first_line
        assert listening_addresses(server.port) == {"00000000000000000000000001000000"}  # ::1 as /proc/net/tcp6 has it
        status, _, body = fetch(server.url + "/runs/trees-run")  # urllib sends Host: [::1]:PORT
        assert status == 200 and "trees-run" in body
        assert fetch(server.url + "/", {"Host": f"localhost:{server.port}"})[0] == 200
        assert fetch(server.url + "/", {"Host": "attacker.example"})[0] == 400
        assert fetch(server.url + "/", {"Host": f"[::2]:{server.port}"})[0] == 400
    finally:
        code, _, err = server.interrupt()
    assert code == 0 and err.strip().splitlines()[-1] == "dfo ui: stopped"


def test_a_busy_port_is_one_line_naming_the_fix(home):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        shown = dfo(home, "ui", "--port", str(port))
    assert shown.returncode == 1 and shown.stdout == ""
    assert shown.stderr.strip().splitlines() == [
        f"dfo: error: cannot serve on 127.0.0.1:{port}: the port is in use (pick another with --port, or --port 0 for "
        "any free one)"]


def test_without_the_ui_extra_it_says_what_to_install_in_one_line(home):
    shown = subprocess.run([sys.executable, "-c", "import sys; sys.modules['uvicorn'] = None; sys.argv = ['dfo', 'ui']; "
                            "from orchestrator.cli import main; main()"], capture_output=True, text=True, timeout=60,
                           env=environment(home))
    assert shown.returncode == 1 and shown.stdout == ""
    assert shown.stderr.strip().splitlines() == [
        "dfo: error: dfo ui needs its web stack (uvicorn is not installed) (pip install 'dfo[ui]')"]
