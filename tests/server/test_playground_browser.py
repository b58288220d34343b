"""The playground in a real browser: headless Chromium (Debian's chromium + chromium-driver, driven by
Selenium) loads the page from a live `specdec serve` on loopback, sends a prompt with Ctrl+Enter,
waits for the stream and checks the coloured tokens, the counters, the race's identical-output
badge and that a bad input shows the server's 400 message. Skipped, saying why, without Chromium.

Screenshots go to the test's tmp dir; with SPECDEC_PLAYGROUND_SHOTS=DIR also to DIR (the README's:
``SPECDEC_PLAYGROUND_MODEL=qwen2.5-coder-0.5b SPECDEC_PLAYGROUND_SHOTS=docs/images pytest
tests/server/test_playground_browser.py``: a real model, in bfloat16, for readable text).
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import make_model_dir
from server_util import ServerProcess

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install selenium")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="no headless browser: install Debian's chromium and chromium-driver "
                                       "(scripts/setup.sh does where apt-get is available)")

MODEL = os.environ.get("SPECDEC_PLAYGROUND_MODEL")  # default: a tiny random model
SHOTS = os.environ.get("SPECDEC_PLAYGROUND_SHOTS")
K = 4
# a tiny random model loops on a repetitive prompt, where n-gram drafts are accepted (and some rejected);
# a real model's copy-heavy task does the same with readable text
PROMPT = ("Rename the variable total to subtotal in this function. Reply with the code only.\n\n"
          "def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n"
          "        total = total + item.price * item.quantity\n    return total * (1 + tax_rate)"
          if MODEL else "the cat the cat the cat the cat the cat the cat")
MAX_TOKENS = 120 if MODEL else 40


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = MODEL or make_model_dir(tmp_path_factory.mktemp("browser") / "model")
    real = ("--dtype", "bfloat16") if MODEL else ()  # the last --dtype wins: a real model in its own dtype
    # --no-cost-aware: drafts shown every step (a random model's n-gram drafts mostly fail: the policy would stop them)
    srv = ServerProcess(model, "--speculative-method", "ngram", "--num-speculative-tokens", str(K), "--no-cost-aware",
                        *real, timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1440,900", "--force-device-scale-factor=1", "--hide-scrollbars"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def wait(driver, what, timeout: float = 60.0, why: str = ""):
    """``what(driver)`` once truthy (polled), else a failure naming ``why``."""
    deadline = time.monotonic() + timeout
    while True:
        got = what(driver)
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {why}: page says {text(driver, 'log')[-500:]!r}")
        time.sleep(0.1)


def text(driver, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id).text


def send(driver, prompt: str, ctrl_enter: bool) -> None:
    """Type ``prompt`` and send it; wait until the page is idle again (its button says Send)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    before = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(prompt)
    if ctrl_enter:
        box.send_keys(Keys.CONTROL, Keys.ENTER)
    else:
        driver.find_element(By.ID, "send").click()
    wait(driver, lambda d: d.find_element(By.ID, "send").text == "Send"
         and len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) > before, why="the answer to finish")


def set_field(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    el = driver.find_element(By.ID, element_id)
    el.clear()
    el.send_keys(value)


def shoot(driver, tmp_path: Path, name: str) -> None:
    driver.save_screenshot(str(tmp_path / name))
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / name, Path(SHOTS) / name)


def api_answer(server: ServerProcess, messages: list[dict], max_tokens: int) -> str:
    """The server's greedy answer to ``messages`` through the API (what the page must show)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        body = {"model": server.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        return json.loads(conn.getresponse().read())["choices"][0]["message"]["content"]
    finally:
        conn.close()


def test_the_playground_streams_coloured_tokens_races_and_shows_errors(server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    d = browser
    d.get(server.url + "/")
    wait(d, lambda d: f"ngram · K {K}" in text(d, "method-name"), 30, "the model card")
    assert d.find_element(By.ID, "prompt").tag_name == "textarea"
    set_field(d, "max-tokens", str(MAX_TOKENS))

    # one turn, sent with Ctrl+Enter: every token coloured by its source, both sources present
    send(d, PROMPT, ctrl_enter=True)
    assert not d.find_elements(By.CSS_SELECTOR, ".error"), text(d, "log")
    answer = d.find_element(By.CSS_SELECTOR, ".msg.assistant .answer")
    toks = answer.find_elements(By.CSS_SELECTOR, ".tok")
    sources = [t.get_attribute("data-source") for t in toks]
    assert set(sources) == {"draft", "target"}, sources
    shown = d.execute_script("return arguments[0].textContent", answer)
    assert shown == "".join(d.execute_script("return arguments[0].textContent", t) for t in toks)
    assert shown == api_answer(server, [{"role": "user", "content": PROMPT}], MAX_TOKENS)
    assert float(text(d, "stat-tps")) > 0
    assert 1.0 < float(text(d, "stat-tps-step")) <= K + 1  # accepted drafts: more than one token per step
    assert text(d, "stat-acceptance").endswith("%") and text(d, "stat-k") == f"ngram · K {K}"
    assert len(d.find_elements(By.CSS_SELECTOR, "#accept-chart rect.bar")) == K
    shoot(d, tmp_path, "playground.png")

    # the race, in a new conversation: plain then speculative, the same greedy text, badges
    d.find_element(By.ID, "new-chat").click()
    d.find_element(By.ID, "race").click()
    send(d, PROMPT, ctrl_enter=False)
    assert not d.find_elements(By.CSS_SELECTOR, ".error"), text(d, "log")
    badge = d.find_element(By.CSS_SELECTOR, ".badge[data-identical]")
    assert badge.get_attribute("data-identical") == "true" and "identical" in badge.text
    assert d.find_element(By.CSS_SELECTOR, ".badge[data-speedup]").text.endswith("the plain speed")
    plain, spec = d.find_elements(By.CSS_SELECTOR, ".lanes .answer")
    assert {t.get_attribute("data-source") for t in plain.find_elements(By.CSS_SELECTOR, ".tok")} == {"target"}
    assert spec.find_elements(By.CSS_SELECTOR, ".tok[data-source=draft]")
    assert all(s.text.endswith("tok/s") for s in d.find_elements(By.CSS_SELECTOR, ".lane-tps"))
    shoot(d, tmp_path, "playground-race.png")

    # bad input: the server's 400 message in the page, and the prompt kept for another try
    d.find_element(By.ID, "race").click()
    set_field(d, "opt-num_speculative_tokens", "99")
    send(d, "hello", ctrl_enter=True)
    err = wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .error"), 10, "the error")[-1].text
    assert err.startswith("400: ") and "num_speculative_tokens" in err, err
    assert d.find_element(By.ID, "prompt").get_attribute("value") == "hello"
