"""``/dashboard`` in a real headless browser (Debian's chromium + chromedriver, driven by
Selenium) against a running stack: 2 simulated engines and the router on loopback.

The page renders, names every instance, updates after traffic without a reload (a
counter changes; a marker set on the window before the traffic is still there), shows the
decision with its reason, and a screenshot is written to the test's tmp dir.

Needs ``scripts/browser-deps.sh`` (chromium, chromedriver; run by ``make test``'s set-up)
and the ``selenium`` package (dev extra): without them it fails, saying which is missing.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from kvtest import engines, send_turns, start_router

SWA = ("--profile", "swa-hybrid", "--time-scale", "20")


def _chrome_paths() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def _need(what: str) -> None:
    pytest.fail(f"{what} missing: run scripts/browser-deps.sh and pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _need("selenium")
    paths = _chrome_paths()
    if paths is None:
        _need("chromium / chromedriver")
    # Explicit binaries: Selenium Manager (which would go to the network) never runs.
    opts = webdriver.ChromeOptions()
    opts.binary_location = paths[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in CI containers
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=paths[1]))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _until(driver, cond, timeout: float = 20.0, what: str = "condition"):
    """Wait for ``cond``; an element the live page re-rendered meanwhile (stale) or has
    not rendered yet is looked up again at the next poll."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(
        driver,
        timeout,
        poll_frequency=0.1,
        ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
    ).until(lambda d: cond(d), message=f"timed out waiting for {what}")


def _text(driver, css: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, css).text


@pytest.mark.timeout(120)
def test_dashboard_renders_every_instance_and_updates_live(browser, tmp_path: Path):
    from selenium.webdriver.common.by import By

    with engines(tmp_path, 2, *SWA) as engs:
        router = start_router(tmp_path, engs)
        try:
            t0 = time.perf_counter()
            browser.get(f"{router.url}/dashboard")
            load_s = time.perf_counter() - t0
            names = _until(
                browser,
                lambda d: {
                    r.get_attribute("data-k")
                    for r in d.find_elements(By.CSS_SELECTOR, "#t-instances tr[data-k]")
                },
                what="the instance rows",
            )
            assert names == {e.url for e in engs}
            assert "kvroute" in browser.title
            # The script took over: it polled the JSON state and re-rendered, live.
            _until(
                browser,
                lambda d: int(d.execute_script("return document.body.dataset.polls")) >= 1,
                what="the first poll",
            )
            _until(browser, lambda d: "live" in _text(d, "#status"), what="the live status")
            assert _text(browser, "#card-requests .v") == "0"
            browser.execute_script("window.__kvrouteMarker = 42")

            prompt = "A shared system prompt seen by the headless browser test. " * 25
            holder = send_turns(router.url, prompt)

            _until(
                browser, lambda d: _text(d, "#card-requests .v") == "3", what="the request counter"
            )
            assert browser.execute_script("return window.__kvrouteMarker") == 42  # no reload
            decisions = _until(
                browser,
                lambda d: (
                    len(rows := d.find_elements(By.CSS_SELECTOR, "#t-decisions tr[data-k]")) == 3
                    and [r.text for r in rows]  # read in the same poll: rows are re-rendered
                ),
                what="three decisions",
            )
            newest = decisions[0]
            assert holder.split("//")[1] in newest and "prefix hit" in newest
            served = _until(
                browser,
                lambda d: (
                    d.find_element(
                        By.CSS_SELECTOR, f'#t-instances tr[data-k="{holder}"] td:nth-child(3)'
                    ).text
                ),
                what="the holder's served count",
            )
            assert served == "3"
            # The index's residency reached the page: the holder holds blocks.
            _until(
                browser,
                lambda d: (
                    d.find_element(
                        By.CSS_SELECTOR, f'#t-residency tr[data-k="{holder}"] td:last-child'
                    ).text
                    not in ("0", "\u2013")
                ),
                what="residency of the holder",
            )
            errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors, errors  # no CSP violation, no script error, no failed fetch
            shot = tmp_path / "dashboard.png"
            assert browser.save_screenshot(str(shot))
            assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            print(f"page load {load_s * 1e3:.0f} ms; screenshot {shot}")
        finally:
            router.stop()
