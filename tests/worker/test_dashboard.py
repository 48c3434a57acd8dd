"""The coordinator's web dashboard, in a real headless Chromium (Debian's
`chromium` and `chromedriver`, installed by deploy/local/setup.sh), driven by
selenium, on a real job trained by a real node agent."""

from __future__ import annotations

import json
import re
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request

import pytest
from cluster import AgentProcess, steps
from sbtest import OPERATOR_TOKEN, wait_for
from springback.client.metrics import COOKIE, SECURITY_HEADERS
from springback.v1 import types_pb2 as pb

pytestmark = pytest.mark.timeout(180)

CHROMEDRIVER = "/usr/bin/chromedriver"
TOKEN = OPERATOR_TOKEN
SPEC = {"name": "dash", "min_workers": 1, "max_workers": 2,
        "data": {"num_samples": 240, "global_batch_size": 12, "seed": 5}, "max_steps": 400,
        "price_per_node_hour": 2.5}
SCREENSHOT = "SPRINGBACK_DASHBOARD_SCREENSHOT"
"""When set, the test saves the job page's screenshot there (docs/dashboard.png)."""


@pytest.fixture
def browser(tmp_path):
    if not os.path.exists(CHROMEDRIVER):
        pytest.fail(f"{CHROMEDRIVER} is missing: run deploy/local/setup.sh (apt chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--window-size=1300,1400", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


LOGIN_FORM = urllib.parse.urlencode({"token": TOKEN, "next": "/"}).encode()


def browser_login(browser, base: str) -> None:  # noqa: ANN001
    """Logs in as a person would: the 401 page's form, the token typed, submitted."""
    from selenium.webdriver.common.by import By

    browser.get(f"{base}/")
    browser.find_element(By.CSS_SELECTOR, "#login input[name=token]").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    wait_for(lambda: browser.find_elements(By.ID, "logout"), 10, "the page after the login")


@pytest.fixture
def running_job(tmp_path, start_coordinator):
    """A coordinator with a token and a dashboard, and a job that is training
    after a rank crash and a restore from its checkpoint."""
    from springback.client.api import Client

    server = start_coordinator(metrics_listen="127.0.0.1:0", token=TOKEN)
    wait_for(server.election.is_leader, 10, "leadership")
    server.dashboard._interval_s = 0.5  # noqa: SLF001 (denser step-rate samples for the plot)
    with Client(server.address, token=TOKEN) as client:
        job = client.create_job({**SPEC, "checkpoint": {"uri": f"file://{tmp_path}/ckpt",
                                                         "every_steps": 10}})
        agent = AgentProcess(tmp_path, "a", job.id, server.address, nproc=2, env={
            "SPRINGBACK_TOKEN": TOKEN, "TINY_STEP_SLEEP_S": "0.15", "TINY_CRASH_AT_STEP": "14",
            "TINY_CRASH_MARKER": str(tmp_path / "crashed")})
        try:
            wait_for(lambda: any(r["step"] >= 16 and r["generation"] >= 3 for r in steps(tmp_path)),
                     60, "training after the crash")
            yield server, client, job.id
        finally:
            agent.stop()


def test_the_dashboard_shows_a_running_job_its_generations_and_plots(browser, running_job):
    from selenium.webdriver.common.by import By

    server, client, job_id = running_job
    base = f"http://{server.metrics_address}"
    with pytest.raises(urllib.error.HTTPError) as refused:  # same auth as the API
        urllib.request.urlopen(f"{base}/", timeout=5)
    assert refused.value.code == 401

    assert set(SECURITY_HEADERS.items()) <= set(refused.value.headers.items())
    browser_login(browser, base)  # opens a session, sets its cookie, redirects to /
    assert browser.current_url == f"{base}/"
    check_the_session_cookie(browser, base)
    assert browser.find_element(By.TAG_NAME, "h1").text == "Springback jobs"
    (row,) = browser.find_elements(By.CSS_SELECTOR, "#jobs tbody tr")
    cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
    assert cells[:3] == [job_id, "dash", "running"] and cells[4] == "2", cells

    row.find_element(By.LINK_TEXT, job_id).click()
    assert browser.current_url == f"{base}/jobs/{job_id}"
    assert browser.find_element(By.TAG_NAME, "h1").text == f"Job {job_id} (dash)"
    wait_for(lambda: client.get_job(job_id).status.step >= 24, 60, "more steps")
    browser.refresh()  # a few step samples later
    generations = browser.find_elements(By.CSS_SELECTOR, "#generations tbody tr")
    kinds = [r.find_elements(By.TAG_NAME, "td")[2].text for r in generations]
    assert kinds[-1] == "start" and kinds[:2] == ["rank_failure", "join"], kinds  # newest first
    crash = [td.text for td in generations[0].find_elements(By.TAG_NAME, "td")]
    # world, where the state came from, the step resumed after: the crashed
    # rank's peer on the same node still held step 13 in memory, so the
    # ranks took it from there rather than from the step-10 commit
    assert crash[3:6] == ["2", "peers", "13"], crash
    assert crash[6] == "0", crash  # nothing redone
    checkpoints = browser.find_elements(By.CSS_SELECTOR, "#checkpoints tbody tr")
    newest = int(checkpoints[0].find_elements(By.TAG_NAME, "td")[0].text)
    assert newest >= 10 and newest % 10 == 0  # every_steps 10, newest first
    goodput = browser.find_element(By.ID, "goodput").text
    assert goodput.endswith("%") and 0 <= float(goodput[:-1]) <= 100
    for plot in ("world-plot", "steps-plot"):
        image = browser.find_element(By.ID, plot)
        wait_for(lambda image=image: browser.execute_script(
            "return arguments[0].complete && arguments[0].naturalWidth", image), 20, f"{plot} drawn")
        assert image.size["width"] > 300 and image.size["height"] > 100
    svg = urllib.request.urlopen(urllib.request.Request(
        f"{base}/jobs/{job_id}/world.svg", headers={"Authorization": f"Bearer {TOKEN}"}), timeout=10)
    assert svg.headers["Content-Type"] == "image/svg+xml" and b"world size" in svg.read()
    check_the_breakdown(browser, client, job_id)
    check_the_live_view(browser, server, client, base, job_id)
    if os.environ.get(SCREENSHOT):  # the whole page, its breakdown included
        browser.set_window_size(1300, browser.execute_script(
            "return document.body.scrollHeight") + 120)
        browser.save_screenshot(os.environ[SCREENSHOT])
    assert client.get_job(job_id).status.state == pb.JOB_STATE_RUNNING


def check_the_session_cookie(browser, base):
    """The browser holds a session id, never the token; the token itself is
    no cookie; every page and script carries the security headers (the job
    page's script runs under that CSP: see check_the_live_view)."""
    (cookie,) = browser.get_cookies()
    assert cookie["name"] == COOKIE and TOKEN not in cookie["value"], cookie
    assert len(cookie["value"]) >= 32 and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert cookie["path"] == "/" and not cookie["secure"]  # plain HTTP here
    for value, code in ((cookie["value"], 200), (TOKEN, 401)):
        request = urllib.request.Request(f"{base}/live.js",
                                         headers={"Cookie": f"{COOKIE}={value}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                got, headers = reply.status, reply.headers
        except urllib.error.HTTPError as refused:
            got, headers = refused.code, refused.headers
        assert got == code, value
        assert set(SECURITY_HEADERS.items()) <= set(headers.items())


def test_over_tls_the_session_cookie_is_secure(tmp_path):
    import ssl
    import subprocess

    from springback.client import metrics

    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=dash",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(tmp_path / "k.pem"),
                    "-out", str(tmp_path / "c.pem")], check=True, capture_output=True, timeout=30)
    server = metrics.serve(metrics.Registry(), "127.0.0.1:0", token=TOKEN,
                           pages={"/": lambda path: (200, "text/plain", b"page")},
                           tls_cert=str(tmp_path / "c.pem"), tls_key=str(tmp_path / "k.pem"))
    try:
        trust = ssl.create_default_context(cafile=str(tmp_path / "c.pem"))
        base = f"https://127.0.0.1:{server.server_address[1]}"

        opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=trust),
                                             NoRedirect)
        with pytest.raises(urllib.error.HTTPError) as login:
            opener.open(f"{base}/login", data=LOGIN_FORM, timeout=10)
        assert login.value.code == 303
        cookie = login.value.headers["Set-Cookie"]
        assert "; Secure" in cookie and "HttpOnly" in cookie and TOKEN not in cookie, cookie
        session = cookie.split(";")[0]
        with opener.open(urllib.request.Request(f"{base}/", headers={"Cookie": session}),
                         timeout=10) as reply:
            assert reply.read() == b"page"
            assert set(SECURITY_HEADERS.items()) <= set(reply.headers.items())
    finally:
        server.shutdown()
        server.server_close()


PAGE = b"<!doctype html><html><head><title>t</title></head><body><h1>page</h1></body></html>"


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # noqa: ANN002, ANN003
        return None


@pytest.fixture
def dashboard():
    """A bare dashboard listener (no coordinator) with one HTML page at /."""
    from springback.client import metrics

    server = metrics.serve(metrics.Registry(), "127.0.0.1:0", token=TOKEN,
                           pages={"/": lambda path: (200, "text/html", PAGE)})
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _call(url: str, *, method: str = "GET", cookie: str | None = None,
          bearer: str | None = None, data: bytes = b"") -> tuple[int, dict, bytes]:
    headers = {"Cookie": f"{COOKIE}={cookie}"} if cookie else {}
    if bearer:
        headers["Authorization"] = f"Bearer {bearer}"
    request = urllib.request.Request(url, data=data if method == "POST" else None,
                                     method=method, headers=headers)
    try:
        with urllib.request.build_opener(NoRedirect).open(request, timeout=10) as reply:
            return reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.headers, refused.read()


def _login(base: str) -> str:
    code, headers, _ = _call(f"{base}/login", method="POST", data=LOGIN_FORM)
    assert code == 303 and headers["Location"] == "/"
    return headers["Set-Cookie"].split(";")[0].removeprefix(f"{COOKIE}=")


def test_logout_ends_the_session_on_the_server_and_clears_the_cookie(dashboard):
    from springback.client.metrics import LOGOUT_FORM

    session, other = _login(dashboard), _login(dashboard)
    code, _, page = _call(f"{dashboard}/", cookie=session)
    assert code == 200 and LOGOUT_FORM in page  # the control, on a page a session opened
    assert LOGOUT_FORM not in _call(f"{dashboard}/", bearer=TOKEN)[2]  # scripts log in per request
    # a GET (a link, an <img>) logs nobody out
    code, headers, _ = _call(f"{dashboard}/logout", cookie=session)
    assert code == 405 and headers["Allow"] == "POST"
    assert _call(f"{dashboard}/", cookie=session)[0] == 200
    code, headers, _ = _call(f"{dashboard}/logout", method="POST", cookie=session)
    assert code == 303 and headers["Location"] == "/"
    cleared = headers["Set-Cookie"]
    assert cleared.startswith(f"{COOKIE}=;") and "Max-Age=0" in cleared, cleared
    assert "SameSite=Strict" in cleared and "HttpOnly" in cleared and "Path=/" in cleared
    assert set(SECURITY_HEADERS.items()) <= set(headers.items())
    # the old id is refused from now on, even by a client that kept it
    assert _call(f"{dashboard}/", cookie=session)[0] == 401
    assert _call(f"{dashboard}/live.js", cookie=session)[0] == 401
    assert _call(f"{dashboard}/logout", method="POST", cookie=session)[0] == 303  # harmless again
    assert _call(f"{dashboard}/", cookie=other)[0] == 200  # only that session ended
    assert _call(f"{dashboard}/", method="POST", cookie=other)[0] == 405  # nothing else is a POST


def test_the_logout_control_works_in_a_browser_under_the_csp(browser, dashboard):
    from selenium.webdriver.common.by import By

    browser_login(browser, dashboard)
    assert browser.find_element(By.TAG_NAME, "h1").text == "page"
    (cookie,) = browser.get_cookies()
    browser.find_element(By.CSS_SELECTOR, "#logout button").click()
    wait_for(lambda: "session ended" in browser.find_element(By.TAG_NAME, "body").text, 10,
             "the login prompt after the logout")
    assert browser.current_url == f"{dashboard}/" and browser.get_cookies() == []
    assert _call(f"{dashboard}/", cookie=cookie["value"])[0] == 401


def _get_json(url: str, token: str | None = TOKEN) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        assert r.headers["Content-Type"] == "application/json"
        return json.load(r)


PLOTTED = """return Array.from(document.querySelectorAll('#loss-plot circle.pt')).map(
    c => [Number(c.dataset.step), Number(c.dataset.loss), Number(c.getAttribute('cx')),
          Number(c.getAttribute('cy'))])"""


def check_the_live_view(browser, server, client, base, job_id):
    """The job page's live loss curve, generation markers and members table,
    polled from series.json / members.json by the page's script, no reload."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.execute_script("window.notReloaded = true")  # gone if the page reloads
    wait = WebDriverWait(browser, 20, poll_frequency=0.2)
    first = wait.until(lambda d: d.execute_script(PLOTTED) or False, "loss curve drawn")
    # the plotted points are the coordinator's: each in the JSON series with
    # its loss, one point per step, x growing with the step, y falling with the loss
    series = {step: loss for _, step, loss in _get_json(f"{base}/jobs/{job_id}/series.json")["points"]}
    for step, loss, _, _ in first:
        assert series[step] == pytest.approx(loss), (step, loss)
    by_step = sorted(first)
    assert [p[0] for p in by_step] == sorted({p[0] for p in first})
    assert all(a[2] < b[2] for a, b in zip(by_step, by_step[1:]))
    assert all((a[1] - b[1]) * (a[3] - b[3]) <= 1e-9 for a, b in zip(first, first[1:]))
    # the series ends at the step and loss the API reports (read when the job
    # did not move between two reads of it)
    def settled(_):  # the series and the status of one quiet moment, or False
        before = client.get_job(job_id).status
        points = _get_json(f"{base}/jobs/{job_id}/series.json")["points"]
        after = client.get_job(job_id).status
        return before.step == after.step and points and (points, after)
    points, status = wait.until(settled, "a quiet moment")
    assert points[-1][1:] == [status.step, pytest.approx(status.loss)]
    # the curve grows without a reload
    grown = wait.until(lambda d: (len(d.execute_script(PLOTTED)) > len(first)
                                  and d.execute_script(PLOTTED)), "more points")
    assert max(p[0] for p in grown) > max(p[0] for p in first)
    assert browser.execute_script("return window.notReloaded") is True
    # a marker at each generation's start, its reason as the tooltip
    events = _get_json(f"{base}/jobs/{job_id}/series.json")["generations"]
    markers = browser.find_elements(By.CSS_SELECTOR, "#loss-plot line.gen-marker")
    assert len(markers) == len(events) >= 3, (len(markers), events)
    for marker, event in zip(markers, events):
        assert int(marker.get_attribute("data-step")) == event["start_step"]
        title = browser.execute_script("return arguments[0].querySelector('title').textContent",
                                       marker)
        assert event["reason"] and event["reason"] in title, (title, event)
    assert [e["kind"] for e in events][:1] == ["start"] and "rank_failure" in [
        e["kind"] for e in events]
    # the members table is the job's members, their ranks covering the world
    status = client.get_job(job_id).status
    def table():
        rows = [[td.text for td in tr.find_elements(By.TAG_NAME, "td")]
                for tr in browser.find_elements(By.CSS_SELECTOR, "#members tbody tr")]
        return rows if [r[0] for r in rows] == [*status.members, *status.spares] else False
    rows = wait.until(lambda d: table(), "members table")
    assert [r[3] for r in rows] == ["active"] * len(status.members) + ["spare"] * len(status.spares)
    ranks = [tuple(map(int, r[2].split(".."))) for r in rows if r[3] == "active"]
    assert ranks[0][0] == 0 and ranks[-1][1] == status.world_size - 1
    assert all(a[1] + 1 == b[0] for a, b in zip(ranks, ranks[1:]))
    assert all(r[1] and r[4] == "no" for r in rows), rows
    # last heartbeat from the member's etcd lease: within its liveness timeout
    liveness_s = server.coordinator.liveness_timeout_s
    for r in rows:
        ago = r[5].removesuffix(" s ago")
        assert ago.isdigit() and int(ago) <= liveness_s, rows
    # the JSON endpoints: same auth as the pages, 404 naming an unknown job
    for name in ("series", "members"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            _get_json(f"{base}/jobs/{job_id}/{name}.json", token=None)
        assert refused.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as missing:
            _get_json(f"{base}/jobs/no-such-job/{name}.json")
        assert missing.value.code == 404
        assert missing.value.headers["Content-Type"] == "application/json"
        error = json.load(missing.value)
        assert error["job"] == "no-such-job" and "no-such-job" in error["error"], error


def _shapes(browser, selector: str) -> list[dict]:
    return browser.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(r => ({"
        "cause: r.dataset.cause, seconds: Number(r.dataset.seconds), "
        "generation: r.dataset.generation, width: Number(r.getAttribute('width'))}))", selector)


def check_the_breakdown(browser, client, job_id):
    """Where the time went (badput by cause: bar, table, per-generation
    timeline), recovery by cause, step-time quantiles and the cost, each
    against what the API computes from the same records at the page's time."""
    from selenium.webdriver.common.by import By
    from springback.client import badput
    from springback.client.summary import job_summary

    bar = browser.find_element(By.ID, "badput-bar")
    now = float(bar.get_attribute("data-now"))
    job, events = client.list_job_events(job_id)
    api = job_summary(job, events, now)
    wall = float(browser.find_element(By.ID, "badput-wall").get_attribute("data-seconds"))
    assert wall == pytest.approx(api["badput"]["wall_s"], abs=0.5)
    shown = {r["cause"]: r["seconds"] for r in _shapes(browser, "#badput-bar rect.cause")}
    assert sum(shown.values()) == pytest.approx(wall, rel=1e-6)  # every second in one cause
    assert sum(r["width"] for r in _shapes(browser, "#badput-bar rect.cause")) == pytest.approx(720, abs=0.05)
    # the records move on while the job trains (the current generation's
    # steps and checkpoint stalls): the API's figures at the same time agree
    # to within the time between the page's load and this read
    for cause in badput.CAUSES:
        assert shown.get(cause, 0.0) == pytest.approx(api["badput"]["causes_s"][cause], abs=0.5), cause
    # what happened here: a start, a rank crash noticed, a re-formed group,
    # state from the peers, checkpoints; nothing redone (crash[6] above)
    assert {"useful", "startup", "detection", "reforming", "checkpoint"} <= set(shown), shown
    assert "redone" not in shown, shown
    table = {tr.find_elements(By.TAG_NAME, "td")[0].text: float(tr.find_elements(
        By.TAG_NAME, "td")[1].text) for tr in browser.find_elements(By.CSS_SELECTOR, "#badput tbody tr")}
    assert set(table) == set(badput.CAUSES)
    for cause in badput.CAUSES:
        assert table[cause] == pytest.approx(shown.get(cause, 0.0), abs=0.006)
    # the timeline: each generation's causes sum to its own wall time
    ticks = browser.find_elements(By.CSS_SELECTOR, "#badput-timeline line.gen-start")
    assert [int(t.get_attribute("data-generation")) for t in ticks] == [e.generation for e in events]
    segments = _shapes(browser, "#badput-timeline rect.cause")
    for tick in ticks:
        generation = tick.get_attribute("data-generation")
        own = sum(r["seconds"] for r in segments if r["generation"] == generation)
        assert own == pytest.approx(float(tick.get_attribute("data-wall")), rel=1e-6, abs=1e-6)
    assert sum(r["seconds"] for r in segments) == pytest.approx(wall, rel=1e-6)
    # recovery by cause: one row per kind of change after the start
    rows = {tr.find_elements(By.TAG_NAME, "td")[0].text: tr.find_elements(By.TAG_NAME, "td")
            for tr in browser.find_elements(By.CSS_SELECTOR, "#recovery-by-kind tbody tr")}
    recovered = [e for e in events if e.HasField("recovery")][1:]
    kinds = {}
    for e in recovered:
        kind = js_kind(e)
        kinds[kind] = kinds.get(kind, 0) + 1
    assert {k: int(v[1].text) for k, v in rows.items()} == kinds and "rank_failure" in kinds
    worst = max(e.recovery.ToNanoseconds() / 1e9 for e in recovered if js_kind(e) == "rank_failure")
    assert rows["rank_failure"][4].text == f"{worst:.2f} s"
    # step time quantiles per generation (newest first), from the events
    cells = [tr.find_elements(By.TAG_NAME, "td")[9].text
             for tr in browser.find_elements(By.CSS_SELECTOR, "#generations tbody tr")]
    quantiles = [e for e in reversed(events)]
    assert any(e.step_p50_s for e in quantiles[1:])
    # the current generation's move on as it trains: its form only
    assert re.fullmatch(r"[0-9.]+ / [0-9.]+ / [0-9.]+ ms|-", cells[0]), cells[0]
    for text, e in zip(cells[1:], quantiles[1:]):
        assert text == (f"{e.step_p50_s * 1e3:.1f} / {e.step_p90_s * 1e3:.1f} / "
                        f"{e.step_p99_s * 1e3:.1f} ms" if e.step_p50_s else "-"), (text, e.generation)
    # node-hours and the money, as `job get --json` has them
    assert float(browser.find_element(By.ID, "node-hours").text) == pytest.approx(
        api["cost"]["node_hours"], abs=1e-3)
    assert float(browser.find_element(By.ID, "cost").text) == pytest.approx(
        api["cost"]["cost"], rel=0.05)


def js_kind(event) -> str:
    from springback.client.summary import event_summary

    return event_summary(event)["kind"]
