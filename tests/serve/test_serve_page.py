"""The chat page at / (runtime/serve/chat.html), driven in a real headless browser (Debian's chromium and its
chromedriver, through selenium): the page loads without the key (it is static), asks for the key, shows the model's
name, and a typed question gets an answer streamed into the page — seen growing before it ends — with its speed. A
screenshot of the answer is written to the test's output (its path printed). The page shows the temperature a request
gets by default (the model's recommended, else llama-server's) and sends the one a user sets: at 0 the README's
question is answered rightly ten times out of ten."""

import os
import shutil
import time

import pytest
from conftest import need

need("fastapi")
webdriver = need("selenium.webdriver")

from serving import Server  # noqa: E402

KEY = "sk-page-test-0123456789"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")


needs_browser = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="no chromium and chromedriver here (Debian: "
                                   "apt-get install chromium chromium-driver)")


def _browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=900,700"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(DRIVER))


def _answer(browser, deadline_s: float = 120) -> str:
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        answer = browser.find_element(By.CSS_SELECTOR, ".assistant")
        if answer.get_attribute("data-done") == "true":
            return answer.text
        time.sleep(0.05)
    raise AssertionError("no answer within the deadline")


@needs_browser
def test_the_page_shows_the_default_temperature_and_sends_the_one_set(serve_export):
    """The page shows the temperature a request that sets none gets (SmolLM2's GGUF recommends none, so
    llama-server's 0.8) and sends the one a user types: at 0 the README's question is answered rightly 10 times of
    10. (At 0.8 this 135M model answers it rightly about half the time, as llama.cpp does with the same defaults on
    the same prompt, 11 of 20: its first token is split, 'The' 0.15, 'L' 0.14, 'La' 0.10.)"""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    s = Server(str(serve_export), "--name", "smol", "--slots", "2", "--max-seq-len", "512")
    browser = _browser()
    try:
        answers = []
        for _ in range(10):
            browser.get(f"{s.url}/")  # a fresh conversation each time
            WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "temperature").get_attribute("value"))
            shown = browser.find_element(By.ID, "temperature").get_attribute("value")
            browser.find_element(By.TAG_NAME, "summary").click()
            browser.find_element(By.ID, "temperature").clear()
            browser.find_element(By.ID, "temperature").send_keys("0")
            browser.find_element(By.ID, "input").send_keys("What is the capital of France?")
            browser.find_element(By.ID, "send").click()
            answers.append(_answer(browser))
        print(f"temperature shown: {shown}; answers: {answers}")
        assert float(shown) == 0.8
        assert all("Paris" in a for a in answers), answers
        assert any("a request that sets no sampling field samples with temperature 0.8 (llama-server)" in line
                   for line in s.lines), "".join(s.lines)
    finally:
        browser.quit()
        assert s.stop() == 0, "".join(s.lines)


@needs_browser
def test_the_chat_page_streams_an_answer_in_a_real_browser(serve_export, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    s = Server(str(serve_export), "--name", "smol", "--slots", "2", "--max-seq-len", "512", "--api-key", KEY)
    browser = _browser()
    try:
        browser.get(f"{s.url}/")  # open without the key: the page is static
        wait = WebDriverWait(browser, 60)
        wait.until(lambda b: "invalid_api_key" in b.page_source or "API key" in b.find_element(By.ID, "model").text)
        browser.find_element(By.TAG_NAME, "summary").click()
        key = browser.find_element(By.ID, "key")
        key.send_keys(KEY)
        browser.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
        wait.until(lambda b: b.find_element(By.ID, "model").text == "smol")
        browser.find_element(By.ID, "max").clear()
        browser.find_element(By.ID, "max").send_keys("48")
        browser.find_element(By.ID, "input").send_keys("Write a short sentence about the sea.")
        browser.find_element(By.ID, "send").click()
        seen, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:  # the answer as the page shows it, while it streams
            answer = browser.find_element(By.CSS_SELECTOR, ".assistant")
            seen.append(answer.text)
            if answer.get_attribute("data-done") == "true":
                break
            time.sleep(0.05)
        final = browser.find_element(By.CSS_SELECTOR, ".assistant").text
        shot = tmp_path / "chat-page.png"
        browser.save_screenshot(str(shot))
        if os.environ.get("LLGRAPH_SCREENSHOTS"):
            shutil.copy(shot, os.environ["LLGRAPH_SCREENSHOTS"])
        partial = [t for t in seen if t and len(t) < len(final)]
        print(f"screenshot: {shot}; answer: {final!r}; {len(partial)} partial views while streaming; speed: "
              f"{browser.find_element(By.ID, 'speed').text!r}")
        assert len(final) > 3 and "error" not in \
            browser.find_element(By.CSS_SELECTOR, ".assistant").get_attribute("class")
        assert partial, "the answer appeared whole, not streamed"
        assert browser.find_element(By.ID, "speed").text.endswith("tok/s")
        assert shot.stat().st_size > 5000
    finally:
        browser.quit()
        assert s.stop() == 0, "".join(s.lines)
