"""The chat page at / in headless Chromium: a typed prompt streams back as tokens colored by origin,
with a running acceptance rate. Keeps a screenshot in artifacts/chat_page.png."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from .test_disconnect_and_overload import SlowEngine

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"

pytestmark = [
    pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                       reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"),
]
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (test extra)")


@pytest.fixture()
def browser(tmp_path):
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--no-proxy-server", "--window-size=1100,800", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(predicate, timeout: float = 30.0, interval: float = 0.03):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("timed out waiting in the page")


def test_page_streams_a_colored_reply(serve, make_engine, browser):
    from selenium.webdriver.common.by import By

    with serve(SlowEngine(make_engine(), 0.02)) as srv:
        browser.get(srv.url + "/")
        _wait(lambda: browser.find_element(By.ID, "model").text == "tiny")
        max_tokens = browser.find_element(By.ID, "max-tokens")
        max_tokens.clear()
        max_tokens.send_keys("96")
        browser.find_element(By.ID, "prompt").send_keys("Write quicksort in Python")
        browser.find_element(By.ID, "send").click()

        counts = set()  # span counts seen while streaming: the reply grows step by step
        def finished():
            counts.add(len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .tok")))
            return browser.find_element(By.ID, "status").get_attribute("data-state") in ("done", "error")
        _wait(finished)
        assert browser.find_element(By.ID, "status").get_attribute("data-state") == "done"
        spans = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .tok")
        assert len(spans) >= 24, "a greedy reply of up to 96 tokens"
        partial = [c for c in counts if 0 < c < len(spans)]
        assert len(partial) >= 3, f"the reply did not stream: span counts seen {sorted(counts)}"

        origins = [s.get_attribute("data-origin") for s in spans]
        assert {"accepted", "recovered", "bonus"} <= set(origins)
        colors = {o: s.value_of_css_property("color") for s, o in zip(spans, origins)}
        assert len({colors["accepted"], colors["recovered"], colors["bonus"]}) == 3, colors
        acceptance = browser.find_element(By.ID, "acceptance").text
        assert acceptance.endswith("%") and 0 < float(acceptance[:-1]) < 100
        assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == "Write quicksort in Python"

        ARTIFACTS.mkdir(exist_ok=True)
        assert browser.save_screenshot(str(ARTIFACTS / "chat_page.png"))
