"""The web view's pages in a real headless Chromium (the system's chromium and chromium-driver, driven by Selenium).

Screenshots of each page are kept under tests/artifacts/web/ (ignored by git) so
a person can look at what the test saw.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest
from conftest import Env, wait_until
from web_helpers import Web, populate, save, start_web


def chromium() -> tuple[str, str]:
    """Return the paths of chromium and chromedriver, or fail naming the packages."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.fail("chromium or chromedriver not found: install Debian's chromium and chromium-driver (.ci/run does)")
    return browser, driver


@pytest.fixture
def browser() -> Iterator[object]:
    """A headless Chromium of the system's packages (Selenium is never let to download one).

    Its profile and every temporary folder it and its driver make live in one folder of
    its own, removed after the test, so that no run leaves an ``org.chromium.Chromium.*``
    folder in /tmp. The folder's path stays short: Chromium puts a Unix socket in it,
    whose path may not exceed 107 bytes (pytest's tmp_path can).
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = chromium()
    with tempfile.TemporaryDirectory(prefix="dispatcher-chromium-", ignore_cleanup_errors=True) as scratch:
        options = webdriver.ChromeOptions()
        options.binary_location = binary
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,640"):
            options.add_argument(arg)
        options.add_argument(f"--user-data-dir={scratch}/profile")
        service = Service(executable_path=driver, env={**os.environ, "TMPDIR": scratch})
        b = webdriver.Chrome(service=service, options=options)
        b.set_page_load_timeout(60)
        try:
            yield b
        finally:
            b.quit()


@pytest.fixture
def site(env: Env) -> Iterator[tuple[Env, Web]]:
    populate(env)
    web = start_web(env)
    yield env, web
    web.stop()


def text_of(b: object, css: str) -> str:
    """Return the text of the first element matching css; read again if a page refresh swapped it meanwhile."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    for _ in range(20):
        try:
            return str(b.find_element(By.CSS_SELECTOR, css).text)  # type: ignore[attr-defined]
        except StaleElementReferenceException:  # the page's own refresh replaced <main> between find and read
            continue
    raise AssertionError(f"{css} kept being replaced")


def shot(b: object, name: str) -> None:
    path = save(name, b.get_screenshot_as_png())  # type: ignore[attr-defined]
    print(f"screenshot: {path}")


def test_overview_job_page_and_chain_of_three_show_in_a_browser(site: tuple[Env, Web], browser: object) -> None:
    """The overview shows counts, the running agent, the spend chart and the daemon; a job page its checks and
    attempts; the chain page draws the three hops with their state and cost; the overview updates by itself."""
    from selenium.webdriver.common.by import By

    _, web = site
    b = browser
    b.get(web.url + "/")  # type: ignore[attr-defined]
    assert text_of(b, "#count-review .n") == "2" and text_of(b, "#count-done .n") == "4"
    assert "SLOW-1" in text_of(b, "#running")
    bars = b.find_elements(By.CSS_SELECTOR, "#spend rect.bar")  # type: ignore[attr-defined]
    assert len(bars) == 6
    assert "Live daemons" in str(b.page_source)  # type: ignore[attr-defined]
    shot(b, "overview.png")

    b.get(web.url + "/jobs/FAIL-1")  # type: ignore[attr-defined]
    assert text_of(b, "#job-state") == "failed"
    assert "exit_ok" in text_of(b, "#checks") and "exit 3" in text_of(b, "#checks")
    attempt = text_of(b, "#attempt-1")
    assert "fakeagent.py" in attempt and "0.05 USD" in attempt and "end of stdout" in attempt.lower()
    shot(b, "job-failed.png")

    b.get(web.url + "/jobs/CHAIN-2/chain")  # type: ignore[attr-defined]
    hops = [h.text for h in b.find_elements(By.CSS_SELECTOR, "#tree .hop")]  # type: ignore[attr-defined]
    assert [h.split()[0] for h in hops] == ["CHAIN-1", "CHAIN-2", "CHAIN-3"]
    assert "done" in hops[2] and "0.1 USD" in hops[2] and "0.3 USD" in hops[0]
    assert "0.6 USD" in text_of(b, "main")
    assert b.find_elements(By.CSS_SELECTOR, "#tree .hop.me")[0].text.startswith("CHAIN-2")  # type: ignore[attr-defined]
    shot(b, "chain.png")

    b.get(web.url + "/review")  # type: ignore[attr-defined]
    assert "REV-A" in text_of(b, "#jobs") and "log in to act" in text_of(b, "#jobs")
    shot(b, "review.png")

    b.get(web.url + "/")  # type: ignore[attr-defined]
    assert web.act("REV-B", "approve", web.token)[0] == 200
    wait_until(lambda: text_of(b, "#count-review .n") == "1", 15, "the overview to show one job in review")


def test_approving_in_the_browser_needs_the_token(site: tuple[Env, Web], browser: object) -> None:
    """Without a login no approve button shows and a forged form is refused; a wrong token is refused;
    logged in with the token, approve moves the job to done/."""
    from selenium.webdriver.common.by import By

    env, web = site
    b = browser
    b.get(web.url + "/jobs/REV-A")  # type: ignore[attr-defined]
    assert not b.find_elements(By.ID, "do-approve")  # type: ignore[attr-defined]
    assert "Log in with the action token to approve, revise, reject" in text_of(b, "#actions")
    forge = (
        "var f = document.createElement('form'); f.method = 'post'; f.action = '/jobs/REV-A/approve';"
        "document.body.appendChild(f); f.submit();"
    )
    b.execute_script(forge)  # type: ignore[attr-defined]
    wait_until(lambda: b.find_elements(By.ID, "error"), 15, "the refusal page")  # type: ignore[attr-defined]
    assert "log in with the action token first" in text_of(b, "#error")
    shot(b, "forged-refused.png")
    assert (env.root / "review" / "REV-A").is_dir()

    b.get(web.url + "/login")  # type: ignore[attr-defined]
    b.find_element(By.ID, "token").send_keys("not-the-token")  # type: ignore[attr-defined]
    b.find_element(By.ID, "login").click()  # type: ignore[attr-defined]
    wait_until(lambda: b.find_elements(By.ID, "login-failed"), 15, "the failed login")  # type: ignore[attr-defined]
    assert "That is not the token" in text_of(b, "#login-failed")

    b.find_element(By.ID, "token").send_keys(web.token)  # type: ignore[attr-defined]
    b.find_element(By.ID, "login").click()  # type: ignore[attr-defined]
    wait_until(lambda: b.find_elements(By.ID, "count-review"), 15, "the overview after login")  # type: ignore[attr-defined]
    b.execute_script(forge)  # type: ignore[attr-defined]  # logged in now, but the forged form has no CSRF token
    wait_until(lambda: b.find_elements(By.ID, "error"), 15, "the refusal page")  # type: ignore[attr-defined]
    assert "CSRF" in text_of(b, "#error")
    assert (env.root / "review" / "REV-A").is_dir()

    b.get(web.url + "/jobs/REV-A")  # type: ignore[attr-defined]
    shot(b, "job-review-logged-in.png")
    b.find_element(By.ID, "do-approve").click()  # type: ignore[attr-defined]
    wait_until(lambda: b.find_elements(By.ID, "message"), 15, "the action's message")  # type: ignore[attr-defined]
    assert text_of(b, "#message") == "REV-A: approved; done" and text_of(b, "#job-state") == "done"
    assert (env.root / "done" / "REV-A" / "result.json").exists()
    shot(b, "job-approved.png")


def test_a_note_typed_and_left_is_not_wiped_by_the_pages_refresh(site: tuple[Env, Web], browser: object) -> None:
    """A revise note typed, then its field left without sending it: the page's refresh leaves it in place (README:
    not while you type in a form); once the field is empty again, the page refreshes as before."""
    from selenium.webdriver.common.by import By

    _env, web = site
    b = browser
    b.get(web.url + "/login")  # type: ignore[attr-defined]
    b.find_element(By.ID, "token").send_keys(web.token)  # type: ignore[attr-defined]
    b.find_element(By.ID, "login").click()  # type: ignore[attr-defined]
    wait_until(lambda: b.find_elements(By.ID, "count-review"), 15, "the overview after login")  # type: ignore[attr-defined]
    b.get(web.url + "/jobs/REV-A")  # type: ignore[attr-defined]

    def refreshed() -> str:
        return str(b.find_element(By.ID, "main").get_attribute("data-refreshed") or "")  # type: ignore[attr-defined]

    wait_until(refreshed, 15, "a first refresh")
    note = b.find_element(By.CSS_SELECTOR, "form[action$='/revise'] input[name=note]")  # type: ignore[attr-defined]
    note.send_keys("use the 2026 rates")
    b.find_element(By.TAG_NAME, "h1").click()  # type: ignore[attr-defined]  # the field is left, its text unsent
    before = refreshed()
    time.sleep(7)  # two refresh periods and more
    assert refreshed() == before
    kept = b.find_element(By.CSS_SELECTOR, "form[action$='/revise'] input[name=note]")  # type: ignore[attr-defined]
    assert kept.get_attribute("value") == "use the 2026 rates"
    b.execute_script("arguments[0].value = ''", kept)  # type: ignore[attr-defined]
    wait_until(lambda: refreshed() != before, 15, "a refresh once the note is gone")
