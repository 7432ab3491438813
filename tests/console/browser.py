"""A headless Chromium for the console's end-to-end tests, driven one
command a line on stdin, one JSON answer a line on stdout
(crates/residentd/tests/e2e/console.rs drives it).

Selenium from the .venv, pointed at Debian's chromium and chromium-driver
(Selenium Manager cannot download a browser here). When either is missing
the first line says {"skip": "<why>"} and the script ends.

Commands (arguments separated by one tab):
  open URL                 load the page
  size W H                 resize the window (CSS pixels)
  dark on|off              emulate prefers-color-scheme: dark
  count CSS N              wait until exactly N elements match CSS
  text CSS WORDS           wait until an element matching CSS contains WORDS
  absent WORDS             whether WORDS are nowhere in the page's text now
  click CSS                click the first element matching CSS (waits for one)
  js EXPR                  the value of a JavaScript expression
  shot PATH                a screenshot of the whole page, to PATH
Each wait is bounded by PATIENCE; its answer gives the seconds it took.
"""

import base64
import json
import os
import shutil
import signal
import sys
import time

PATIENCE = 10.0
POLL = 0.02
CHROMIUM = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"


def say(**answer):
    print(json.dumps(answer), flush=True)


def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        return None, f"selenium is not in the .venv ({e}): run scripts/test"
    for path in (CHROMIUM, DRIVER):
        if not shutil.which(path):
            return None, f"{path} is missing: apt-get install chromium chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu",
                 "--disable-dev-shm-usage", "--window-size=1280,900",
                 "--force-device-scale-factor=1"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(DRIVER), options=options), None


def wait(check):
    """Seconds until check() holds, or None after PATIENCE."""
    began = time.monotonic()
    while True:
        if check():
            return time.monotonic() - began
        if time.monotonic() - began > PATIENCE:
            return None
        time.sleep(POLL)


def run(driver, command, args):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def matching(css):
        return driver.find_elements(By.CSS_SELECTOR, css)

    if command == "open":
        began = time.monotonic()
        driver.get(args[0])
        return {"ok": True, "took": time.monotonic() - began}
    if command == "size":
        driver.set_window_size(int(args[0]), int(args[1]))
        return {"ok": True}
    if command == "dark":
        scheme = "dark" if args[0] == "on" else "light"
        driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {
            "features": [{"name": "prefers-color-scheme", "value": scheme}]})
        return {"ok": True}
    if command == "count":
        css, want = args[0], int(args[1])
        took = wait(lambda: len(matching(css)) == want)
        return {"ok": took is not None, "took": took, "found": len(matching(css))}
    if command == "text":
        css, words = args
        def has():
            try:
                return any(words in e.text for e in matching(css))
            except Exception:  # the element was redrawn between find and read
                return False
        took = wait(has)
        texts = [e.text for e in matching(css)][:5] if took is None else None
        return {"ok": took is not None, "took": took, "seen": texts}
    if command == "absent":
        body = driver.find_element(By.TAG_NAME, "body").text
        return {"ok": args[0] not in body}
    if command == "click":
        def click():
            try:
                matching(args[0])[0].click()
                return True
            except (IndexError, StaleElementReferenceException):
                return False
        took = wait(click)
        return {"ok": took is not None, "took": took}
    if command == "js":
        return {"ok": True, "value": driver.execute_script(f"return ({args[0]});")}
    if command == "shot":
        # The whole page, beyond the window's height.
        width = driver.execute_script("return window.innerWidth;")
        height = driver.execute_script("return document.documentElement.scrollHeight;")
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
        with open(args[0], "wb") as f:
            f.write(base64.b64decode(shot["data"]))
        return {"ok": True, "bytes": os.path.getsize(args[0])}
    return {"ok": False, "error": f"unknown command {command!r}"}


def main():
    # A SIGTERM ends it as the end of its input does: the driver quits
    # (chromedriver and its chromium with it) in the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    driver, why = browser()
    if driver is None:
        say(skip=why)
        return
    try:
        say(ready=True, version=driver.capabilities.get("browserVersion"))
        for line in sys.stdin:
            command, *args = line.rstrip("\n").split("\t")
            try:
                say(**run(driver, command, args))
            except Exception as e:  # said to the test, which fails with it
                say(ok=False, error=f"{type(e).__name__}: {e}")
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
