"""The status page in a real browser (Debian's headless chromium driven by Playwright)
against a real server on loopback with real data: pushed snapshots, an agent's reports
(a broken build with its traceback, a build in progress), a workload changed after its
snapshot. Plus the CSRF and auth refusals over plain HTTP.

Without chromium or Playwright the browser tests skip and say why (``scripts/test``
installs chromium with apt-get when it runs as root).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachekeeper.fingerprint import digest_of
from cachekeeper.server.settings import Settings
from tests.helpers.live_server import LiveServer, start_server
from tests.helpers.ui_data import ADMIN, DIGEST, EXPECTED, TOKENS, seed
from tests.server.conftest import make_snapshot, push

CHROMIUM = "/usr/bin/chromium"
TOML_ELSEWHERE = 'name = "elsewhere"\n[[entrypoint]]\ntarget = "p.m:f"\n'


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, dict[str, str]]]:
    data = tmp_path_factory.mktemp("ui-data")
    live = start_server(Settings(data_dir=data, tokens=TOKENS, gc_grace_s=3600))
    try:
        yield live, seed(live.url)
    finally:
        live.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no browser: {CHROMIUM} is missing (apt-get install chromium, as root)")
    try:
        from playwright.sync_api import sync_playwright  # only the browser tests need it
    except ImportError:
        pytest.skip(
            "no browser driver: Playwright for Python is not installed (pip install playwright)"
        )
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context()
    page = context.new_page()
    page.console_errors = []
    page.on("console", lambda m: m.type == "error" and page.console_errors.append(m.text))
    page.on("pageerror", lambda e: page.console_errors.append(str(e)))
    try:
        yield page
    finally:
        context.close()


def _login(page: Any, url: str, token: str) -> None:
    page.goto(f"{url}/")
    assert "/ui/login" in page.url
    page.fill("input[name=token]", token)
    page.click("#login button")
    page.wait_for_url(re.compile(r".*/(ui)?$"))


def test_page_shows_every_state_with_no_console_errors(page: Any, seeded: Any) -> None:
    live, ids = seeded
    _login(page, live.url, "read-token-1")
    for workload, state in EXPECTED.items():
        cell = page.locator(f'td.cell[data-workload="{workload}"][data-digest="{DIGEST}"]')
        assert cell.get_attribute("data-state") == state, workload
        assert state.replace("_", " ") in cell.inner_text()
    assert "builder-a" in page.locator("#agents").inner_text()
    assert "gpt since" in page.locator("#agents").inner_text()  # the current build
    snapshots = page.locator("#snapshots").inner_text()
    assert ids["resnet"][:12] in snapshots and "8.8 KiB" in snapshots
    assert page.locator("#plot svg path.size").count() == 1
    assert page.locator("#plot svg rect.restores").count() == 1  # today's 3 restores
    resnet = page.locator('td.cell[data-workload="resnet"]').inner_text()
    assert "restored 75%" in resnet and "compiled anyway 33%" in resnet
    assert "torch 2.13.0+cpu" in page.locator("#matrix").inner_text()
    assert page.console_errors == []


def test_detail_page_shows_the_traceback_and_fingerprint(page: Any, seeded: Any) -> None:
    live, _ = seeded
    _login(page, live.url, "read-token-1")
    page.click('td.cell[data-workload="llama"] a')
    page.wait_for_url(re.compile(r".*/ui/cell\?.*"))
    assert (
        "ValueError: shapes (4, 8) and (9, 2) not aligned"
        in page.locator("#traceback").inner_text()
    )
    assert '"driver": "580.10"' in page.locator("#fingerprint").inner_text()
    assert page.console_errors == []


def test_auth_redirects_to_login_and_back(page: Any, seeded: Any) -> None:
    live, _ = seeded
    target = f"{live.url}/ui/cell?workload=llama&digest={DIGEST}"
    page.goto(target)
    assert "/ui/login?next=" in page.url
    page.fill("input[name=token]", "not-a-token")
    page.click("#login button")
    assert "not known" in page.locator("#login-error").inner_text()
    page.fill("input[name=token]", "read-token-1")
    page.click("#login button")
    page.wait_for_url(target)
    assert "token" not in page.url  # never in the URL
    cookie = next(c for c in page.context.cookies() if c["name"] == "ck_token")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert page.evaluate("document.cookie") == ""  # HttpOnly: scripts cannot read either cookie
    page.click("header button")  # log out
    page.wait_for_url(re.compile(r".*/ui/login$"))
    page.goto(f"{live.url}/ui")
    assert "/ui/login" in page.url


def test_read_token_sees_no_admin_action(page: Any, seeded: Any) -> None:
    live, _ = seeded
    _login(page, live.url, "read-token-1")
    assert page.locator("#scope").inner_text() == "read"
    assert page.locator("form.admin, td.admin, #gc").count() == 0


def test_admin_pins_a_snapshot_after_confirming(page: Any, seeded: Any) -> None:
    live, ids = seeded
    _login(page, live.url, "admin-token-1")
    row = page.locator(f'tr[data-snapshot="{ids["bert"]}"]')
    page.once("dialog", lambda d: d.dismiss())  # cancelled: nothing happens
    row.locator("button", has_text="pin").first.click()
    assert "/ui/snapshots" not in page.url
    page.once("dialog", lambda d: d.accept())
    row.locator("button", has_text="pin").first.click()
    page.wait_for_url(re.compile(r".*/ui/snapshots/.*/pin$"))
    assert "pinned" in page.locator("#message").inner_text()
    with httpx.Client(base_url=live.url, headers=ADMIN) as c:
        listed = {s["id"]: s for s in c.get("/v1/snapshots").json()["snapshots"]}
    assert listed[ids["bert"]]["pinned"] is True
    assert page.console_errors == []


def test_admin_post_without_matching_csrf_is_refused(seeded: Any) -> None:
    live, ids = seeded
    with httpx.Client(base_url=live.url) as c:
        c.cookies.set("ck_token", "admin-token-1")
        c.cookies.set("ck_csrf", "cookie-value")
        for form in ({}, {"csrf": "other-value"}):
            r = c.post(f"/ui/snapshots/{ids['resnet']}/delete", data=form)
            assert r.status_code == 403 and "CSRF" in r.text
        listed = c.get("/v1/snapshots", headers=ADMIN).json()["snapshots"]
        assert ids["resnet"] in {s["id"] for s in listed}  # nothing deleted
        c.cookies.set("ck_token", "read-token-1")
        r = c.post(f"/ui/snapshots/{ids['resnet']}/delete", data={"csrf": "cookie-value"})
        assert r.status_code == 403 and "needs the &#39;admin&#39; scope" in r.text
        ids_now = {s["id"] for s in c.get("/v1/snapshots", headers=ADMIN).json()["snapshots"]}
        assert ids["resnet"] in ids_now


def test_login_next_never_leaves_the_server(seeded: Any) -> None:
    live, _ = seeded
    with httpx.Client(base_url=live.url) as c:
        form = c.get("/ui/login", params={"next": "//evil.example/x"}).text
        assert 'value="/ui"' in form
        csrf = c.cookies["ck_csrf"]
        r = c.post(
            "/ui/login",
            data={"token": "read-token-1", "csrf": csrf, "next": "https://evil.example/"},
        )
        assert r.status_code == 303 and r.headers["location"] == "/ui"


def test_bearer_api_is_unchanged_by_the_cookie(seeded: Any) -> None:
    live, _ = seeded
    with httpx.Client(base_url=live.url) as c:
        c.cookies.set("ck_token", "admin-token-1")
        assert c.get("/v1/snapshots").status_code == 401  # the JSON API reads only the bearer


def test_page_is_open_with_auth_off(tmp_path: Path) -> None:
    with start_server(Settings(data_dir=tmp_path / "data")) as live:
        r = httpx.get(f"{live.url}/")
        assert r.status_code == 200 and "No workloads" in r.text
        assert "no snapshots stored yet" in r.text


def test_two_environments_that_differ_only_in_cpu_threads_are_told_apart(
    tmp_path: Path,
) -> None:
    """Issue 25: the header showed torch, Triton, CUDA, driver and GPUs only, so a 1-thread
    and a 2-thread CPU environment (torchrun's ranks and a plain shell) looked the same."""
    from cachekeeper import cpu
    from cachekeeper.fingerprint import collect

    base = collect(environ={"OMP_NUM_THREADS": "2"})
    with start_server(Settings(data_dir=tmp_path / "data")) as live:
        for name, threads in (("one", 1), ("two", 2)):
            fingerprint = dict(base, cpu=cpu.with_threads(base["cpu"], threads))
            agent = {"name": name, "fingerprint": fingerprint, "devices": ["cpu"]}
            httpx.post(f"{live.url}/v1/agents", json=agent).raise_for_status()
        httpx.put(
            f"{live.url}/v1/workloads/w", content='name = "w"\n[[entrypoint]]\ntarget = "p.m:f"\n'
        ).raise_for_status()
        page = httpx.get(f"{live.url}/ui").text
    headers = re.findall(r'<th class="env">(.*?)</th>', page, re.S)
    assert len(headers) == 2 and headers[0].split("<br>", 1)[1] != headers[1].split("<br>", 1)[1]
    assert any("CPU 1 thread" in h and "CPU 2 threads" not in h for h in headers), headers
    assert any("CPU 2 threads" in h for h in headers), headers


def test_two_environments_that_read_the_same_show_what_separates_them(tmp_path: Path) -> None:
    """Issue 31: two columns read "torch 2.13.0+cpu · CPU 1 thread, avx2" and nothing told
    them apart: the per-key tier's switch in torch's key (``env``) was the difference. A
    workload with no row in a column is an empty cell there, not "missing"."""
    from cachekeeper import cpu
    from cachekeeper.fingerprint import collect

    base = collect(environ={"OMP_NUM_THREADS": "1"})
    plain = dict(base, env={})
    tier = dict(base, env={"TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1"})
    two = dict(base, env={}, cpu=cpu.with_threads(base["cpu"], 2))
    with start_server(Settings(data_dir=tmp_path / "data")) as live:
        for name, fingerprint in (("plain", plain), ("tier", tier)):
            agent = {"name": name, "fingerprint": fingerprint, "devices": ["cpu"]}
            httpx.post(f"{live.url}/v1/agents", json=agent).raise_for_status()
        httpx.put(
            f"{live.url}/v1/workloads/w", content='name = "w"\n[[entrypoint]]\ntarget = "p.m:f"\n'
        ).raise_for_status()
        manifest, blobs = make_snapshot(
            {"a": b"a"}, workload="elsewhere", fingerprint=two, devices=("cpu",), verified=True
        )
        with httpx.Client(base_url=live.url) as c:
            assert c.put("/v1/workloads/elsewhere", content=TOML_ELSEWHERE).is_success
            assert push(c, manifest, blobs).status_code == 201
        page = httpx.get(f"{live.url}/ui").text
    headers = re.findall(r'<th class="env">(.*?)</th>', page, re.S)
    assert len(headers) == 3
    by_digest = {digest_of(fp)[:12]: fp for fp in (plain, tier, two)}
    shown = {re.search(r">([0-9a-f]{12})<", h).group(1): h for h in headers}  # type: ignore[union-attr]
    assert set(shown) == set(by_digest)
    plain_h, tier_h = shown[digest_of(plain)[:12]], shown[digest_of(tier)[:12]]
    assert "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE unset" in plain_h
    assert "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE=1" in tier_h
    assert 'class="distinct"' not in shown[digest_of(two)[:12]]  # its label is its own
    # "w" has a row for each agent's environment (nothing built: missing, truly), none in
    # the column only a snapshot of another workload makes: an empty cell, not "missing"
    cells = {
        d[:12]: state
        for state, d in re.findall(
            r'<td class="cell ([a-z_]+)" data-workload="w" data-digest="(\w+)"', page
        )
    }
    assert cells == {
        digest_of(plain)[:12]: "missing",
        digest_of(tier)[:12]: "missing",
        digest_of(two)[:12]: "none",
    }, cells
