"""The operator view: the dashboard in a real browser (headless Chromium) on a running job
with a crash and a migration asked from the page; the Prometheus endpoint parsed with the
client's own parser, its counters against summary.json; access control."""
import json
import os
import secrets
import shutil
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import browser
from mp_harness import set_migration_downtime, wait_for
from test_failures import job, with_faults
from trainmover.api import Job
from trainmover.core.config import DashboardConfig
from trainmover.core import rundir
from trainmover.core.faults import Inject
from trainmover.view.server import start_dashboard

RECORDED = os.path.join(os.path.dirname(__file__), "data", "recorded_run")
# where the screenshot is kept (CI keeps the folder as an artifact)
ARTIFACTS = os.environ.get("TRAINMOVER_TEST_ARTIFACTS",
                           os.path.join(os.path.dirname(__file__), "artifacts"))


def fetch(url, token=None, method="GET", body=None, headers=None):
    h = dict(headers or {})
    if token:
        h["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        h["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(board) -> dict:
    """{(name, labels as a sorted tuple): value} from the board's /metrics."""
    status, text = fetch(board.url + "metrics", board.token)
    assert status == 200, text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def recorded_copy(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    secret = secrets.token_hex(32).encode()
    (run / "secret").write_bytes(secret)
    # its job.json sealed as the job's controller would have (readers check the MAC)
    rundir.write_sealed(str(run), "job.json", (run / "job.json").read_bytes(), secret)
    return str(run)


def counters_match_summary(values, summary):
    """The metrics' counters against the summary's lists (counted here, independently)."""
    def count(items, status):
        return sum(1 for x in items if x["status"] == status)

    for what, plural in (("migrations", "migrations"), ("recoveries", "recoveries")):
        statuses = {x["status"] for x in summary[what]}
        for st in statuses:
            assert values[(f"trainmover_{plural}_total", (("status", st),))] == \
                count(summary[what], st), (what, st)
    kinds = {}
    for rec in summary["recoveries"]:
        for kind in rec["failures"].values():
            kinds[kind] = kinds.get(kind, 0) + 1
    for kind, n in kinds.items():
        assert values[("trainmover_failures_total", (("kind", kind),))] == n
    done = [x for x in summary["migrations"] + summary["recoveries"]
            if x["status"] == "done" and x.get("downtime_s") is not None]
    total = sum(v for (name, _), v in values.items()
                if name == "trainmover_interruption_downtime_seconds_count")
    assert total == len(done)
    got_sum = sum(v for (name, _), v in values.items()
                  if name == "trainmover_interruption_downtime_seconds_sum")
    assert abs(got_sum - sum(x["downtime_s"] for x in done)) < 1e-6


@pytest.mark.timeout(60)
def test_metrics_of_a_recorded_run_match_its_summary(tmp_path):
    run = recorded_copy(tmp_path)
    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    board = start_dashboard(run, DashboardConfig(port=0))
    try:
        values = scrape(board)
    finally:
        board.stop()
    assert summary["migrations"] and summary["recoveries"]   # the recording has both
    counters_match_summary(values, summary)
    assert values[("trainmover_step", ())] == summary["steps"]
    assert values[("trainmover_job_running", ())] == 0
    # a planned migration's downtime lands in its kind's bucket, a crash's in its own
    assert values[("trainmover_interruption_downtime_seconds_count", (("kind", "planned"),))] == 1
    assert values[("trainmover_interruption_downtime_seconds_count", (("kind", "crash"),))] == 1


@pytest.mark.timeout(60)
def test_every_route_but_static_files_needs_the_token(tmp_path):
    run = recorded_copy(tmp_path)
    board = start_dashboard(run, DashboardConfig(port=0))
    try:
        u = board.url
        assert fetch(u + "api/state")[0] == 401
        assert fetch(u + "metrics")[0] == 401
        assert fetch(u + "metrics", token="0" * 64)[0] == 401
        assert fetch(u + "?token=" + "0" * 64)[0] == 401
        assert fetch(u + "api/migrate", method="POST", body={"workers": ["w0"]})[0] == 401
        # a body is not even read without the token (the drain route once parsed it first:
        # junk gave a server error)
        assert fetch(u + "api/drain", method="POST", body="not an object")[0] == 401
        # signed in, but without the header another site's page cannot send
        assert fetch(u + "api/migrate", board.token, "POST", {"workers": ["w0"]})[0] == 403
        assert fetch(u + "api/drain", board.token, "POST", {"host": 1})[0] == 403
        # nor megabytes with it
        big = {"workers": ["w0"] * 20000}
        assert fetch(u + "api/migrate", board.token, "POST", big,
                     headers={"X-Trainmover": "1"})[0] == 413
        assert fetch(u + "api/state", board.token)[0] == 200
        assert fetch(u + "static/app.js")[0] == 200
        with open(os.path.join(run, "dashboard.json")) as f:
            info = json.load(f)
        assert info["login_url"] == board.login_url
        assert oct(os.stat(os.path.join(run, "dashboard.json")).st_mode & 0o777) == "0o600"
    finally:
        board.stop()


@pytest.mark.timeout(60)
def test_the_page_gets_each_downtime_worded_as_everywhere_else(tmp_path):
    """The interruption panel shows the server's words (core/accounting.py, as status,
    report and demo): a migration inside the step noise is no measurable stall, with the
    noise beside it, never a negative number."""
    run = recorded_copy(tmp_path)
    set_migration_downtime(run, -0.004, 0.009)
    board = start_dashboard(run, DashboardConfig(port=0))
    try:
        status, text = fetch(board.url + "api/state", board.token)
        assert status == 200, text
        shown = {i["title"]: i["downtime_text"] for i in json.loads(text)["interruptions"]}
    finally:
        board.stop()
    assert shown["migration 1"] == "no measurable stall (within step noise, ±9.0 ms)"
    assert shown["recovery 1"] == "downtime 212.4 ms"      # its recorded 0.21238 s


def _page_ready(driver):
    return driver.execute_script("return document.body.dataset.loaded") == "1"


def _text(driver, title):
    """An interruption's text, read in one script call ("" while it is not shown)."""
    return driver.execute_script(
        "const e = document.querySelector(`details.interruption[data-title=\"${arguments[0]}\"]`);"
        "return e ? e.textContent : ''", title)


def _click(driver, selector) -> bool:
    """Clicks what ``selector`` names; False if the page redrew it between the find and the
    click (the roles table is rebuilt every refresh, its ticks kept: a stale element
    reference once failed this test), to be found again."""
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        driver.find_element("css selector", selector).click()
        return True
    except StaleElementReferenceException:
        return False


def _phases(driver, title):
    """The phases of an interruption's bar, read in one script call: the page redraws its
    panels every refresh, so elements found in one call may be gone by the next (a stale
    element reference once failed this test)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll("
        "`details.interruption[data-title=\"${arguments[0]}\"] .bar .phase`))"
        ".map(p => p.dataset.phase)", title)


@pytest.mark.timeout(300)
def test_dashboard_in_chromium_shows_a_crash_and_moves_a_worker(tmp_path):
    why = browser.available()
    if why is not None:
        if os.environ.get("TRAINMOVER_REQUIRE_BROWSER"):
            pytest.fail(f"a browser test must run here: {why}")
        pytest.skip(why)
    from selenium.webdriver.support.ui import WebDriverWait

    run_dir = str(tmp_path / "run")
    cfg = with_faults(job(steps=3000, standbys=2, dashboard_port=0),
                      Inject("crash", 25, "w2"))
    running = Job(cfg, run_dir, timeout_s=280).start()
    driver = browser.chromium()
    try:
        board = running.dashboard
        driver.get(board.login_url)
        wait = WebDriverWait(driver, 120, poll_frequency=0.2)
        wait.until(_page_ready)
        # the roles table: every role's holder, with its measurements once published
        wait.until(lambda d: len(d.find_elements("css selector", "#roles tbody tr")) == 4)
        # the crash and its recovery, with its phases
        wait.until(lambda d: "crash" in _text(d, "recovery 1") and "w2" in _text(d, "recovery 1"))
        assert _phases(driver, "recovery 1") == ["detect_s", "collect_s",
                                                 "rebuild_and_first_step_s"]
        # a migration asked from the page, through the job's authenticated request path
        wait.until(lambda d: len(d.find_elements(
            "css selector", '#standbys tr[data-standby] td:nth-child(2)')) >= 1 and any(
            td.text == "warm" for td in d.find_elements(
                "css selector", "#standbys tr[data-standby] td:nth-child(2)")))
        wait.until(lambda d: _click(d, '#roles input[value="w0"]'))
        driver.find_element("id", "migrate-btn").click()
        wait.until(lambda d: all(w in _text(d, "migration 1") for w in ("planned", "done", "w0")))
        assert _phases(driver, "migration 1") == \
            ["prepare_s", "wait_boundary_s", "transfer_s", "group_switch_s", "first_step_s"]
        # a downtime inside the steps' own spread reads as such, never as a negative number
        moved = _text(driver, "migration 1")
        assert "downtime -" not in moved and ("no measurable stall (within step noise" in moved
                                              or "— downtime " in moved), moved
        wait.until(lambda d: "done" in d.find_element("id", "requests").text)
        wait.until(lambda d: not d.find_elements("css selector",
                                                 '#roles tr[data-worker="w0"]'))
        os.makedirs(ARTIFACTS, exist_ok=True)
        driver.save_screenshot(os.path.join(ARTIFACTS, "dashboard.png"))
        errors = [e for e in driver.get_log("browser")
                  if e["level"] == "SEVERE" and "favicon" not in e["message"]]
        assert errors == []
        live = scrape(board)
        assert live[("trainmover_workers", ())] == 4
        assert live[("trainmover_job_running", ())] == 1
    finally:
        browser.close(driver)
        running.stop("test done")
    summary = running.wait(240)
    (mig,) = summary["migrations"]
    assert mig["source"] == "dashboard" and mig["pairs"][0]["leaver"] == "w0"
    # the finished job's metrics, served by `trainmover dashboard` beside the run dir
    board = start_dashboard(run_dir, DashboardConfig(port=0))
    try:
        wait_for(lambda: scrape(board)[("trainmover_job_running", ())] == 0, 30, "job ended")
        counters_match_summary(scrape(board), summary)
    finally:
        board.stop()


def test_a_dashboard_port_in_use_or_out_of_range_is_refused_before_launch(tmp_path):
    import socket

    from trainmover.cli import main
    from trainmover.view.launch import check_dashboard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"--dashboard {port}: .*in use"):
            check_dashboard(DashboardConfig(port=port))
        run_dir = tmp_path / "run"
        assert main(["run", "--recipe", "tiny", "--steps", "2", "--dashboard", str(port),
                     "--run-dir", str(run_dir), "--quiet"]) == 2
        assert not (run_dir / "events.jsonl").exists()   # nothing was launched
    assert main(["run", "--recipe", "tiny", "--steps", "2", "--dashboard", "70000",
                 "--run-dir", str(tmp_path / "other"), "--quiet"]) == 2


@pytest.mark.timeout(240)
def test_status_answers_from_the_controllers_file_without_torch_and_matches_the_store(
        tmp_path):
    import subprocess
    import sys

    from trainmover.control.status import read_status, read_status_file

    run_dir = str(tmp_path / "run")
    running = Job(job(steps=3000, standbys=1), run_dir, timeout_s=220).start()
    try:
        wait_for(lambda: (s := read_status_file(run_dir, 3.0)) is not None and
                 s.committed_step > 5 and s.standbys and s.standbys[0].state == "warm",
                 120, "a status file with a warm standby")
        probe = ("import json, sys; from trainmover.cli import main; "
                 f"rc = main(['status', '--run-dir', {run_dir!r}, '--json']); "
                 "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules}))")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))})
        lines = out.stdout.strip().splitlines()
        verdict = json.loads(lines[-1])
        shown = json.loads("\n".join(lines[:-1]))
        assert verdict == {"rc": 0, "torch": False}, out.stderr
        assert shown["source"] == "controller"
        assert {w["name"]: w["role"] for w in shown["workers"]} == \
            {"w0": "dp0.pp0.tp0", "w1": "dp0.pp1.tp0", "w2": "dp1.pp0.tp0", "w3": "dp1.pp1.tp0"}
        # the store's view (what status reads while the controller is down) says the same
        from_store = read_status(run_dir)
        assert from_store.source == "store"
        assert [(w.name, w.role, w.pid) for w in from_store.workers] == \
            [(w["name"], w["role"], w["pid"]) for w in shown["workers"]]
        assert [(s.name, s.pid) for s in from_store.standbys] == \
            [(s["name"], s["pid"]) for s in shown["standbys"]]
    finally:
        running.stop("test done")
    running.wait(200)
