"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``)
driven by Selenium. ``browser()`` is what the browser test uses; ``main`` makes the README's
screenshot: a cluster under a steady mix of searches, lookups and buys, its catalog leader killed
from the page, a new leader, the old one started again and caught up.

    python -m pygmy.experiments.dashboard_shot --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from pygmy.client.api import PygmyClient, PygmyError
from pygmy.cluster.local import start_cluster


def chromium_paths() -> tuple[str, str] | None:
    """The Chromium binary and its driver, if both are installed."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (binary, driver) if binary and driver else None


@contextlib.contextmanager
def browser(width: int = 1400, height: int = 1080) -> Iterator[WebDriver]:
    """A headless Chromium (``--no-sandbox``: we may run as root), quit on exit."""
    paths = chromium_paths()
    if paths is None:
        raise RuntimeError("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--hide-scrollbars"):
        opts.add_argument(arg)
    opts.binary_location = paths[0]
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(paths[1]))
    try:
        driver.set_page_load_timeout(20)
        yield driver
    finally:
        driver.quit()


def wait_for(driver: WebDriver, what: str, check: Callable[[WebDriver], Any], timeout: float = 15.0) -> Any:
    """Until ``check`` gives something true; the page's console log in the error otherwise."""
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(check)
    except Exception as exc:
        logs = "\n".join(str(e) for e in driver.get_log("browser"))
        raise AssertionError(f"the page did not show {what} within {timeout:.0f} s\n{logs}") from exc


def replica(driver: WebDriver, name: str) -> dict[str, str]:
    """One replica card as the page shows it: role, state, lag, and whether it is marked leader."""
    card = driver.find_element(By.CSS_SELECTOR, f'.replica[data-name="{name}"]')
    return {"role": card.get_attribute("data-role") or "", "state": card.get_attribute("data-state") or "",
            "lag": card.get_attribute("data-lag") or "", "leader": "leader" in (card.get_attribute("class") or "")}


def leader_on_page(driver: WebDriver, tier: str) -> str | None:
    cards = driver.find_elements(By.CSS_SELECTOR, f'#tier-{tier} .replica.leader')
    return cards[0].get_attribute("data-name") if len(cards) == 1 else None


def press(driver: WebDriver, name: str, action: str) -> None:
    driver.find_element(By.CSS_SELECTOR, f'.replica[data-name="{name}"] button[data-action="{action}"]').click()


def enter_token(driver: WebDriver, token: str) -> None:
    box = driver.find_element(By.ID, "token")
    box.clear()
    box.send_keys(token)


def events(driver: WebDriver) -> list[str]:
    return [li.text for li in driver.find_elements(By.CSS_SELECTOR, "#events li")]


def _load(url: str, token: str, stop: threading.Event) -> None:
    """A gentle steady mix, so the charts have something to show; sold-out books are restocked."""
    with PygmyClient(url, timeout=5, token=token) as client:
        n = 0
        while not stop.is_set():
            n += 1
            item = n % 7 + 1
            with contextlib.suppress(PygmyError, OSError):
                client.lookup(item)
                client.search("distributed systems")
                if n % 3 == 0:
                    try:
                        client.buy(item)
                    except PygmyError as exc:
                        if exc.status == 409:
                            client.update(item, stock_delta=100)
            stop.wait(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/dashboard.png")
    parser.add_argument("--before", type=float, default=40, help="seconds of load before the kill")
    parser.add_argument("--after", type=float, default=40, help="seconds of load after the restart")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pygmy-shot-") as tmp:
        c = start_cluster(Path(tmp))
        stop = threading.Event()
        loaders = [threading.Thread(target=_load, args=(c.url, c.admin_token(), stop), daemon=True) for _ in range(3)]
        try:
            for t in loaders:
                t.start()
            with browser() as d:
                d.get(c.url + "/dashboard")
                enter_token(d, c.admin_token())
                old = wait_for(d, "a catalog leader", lambda d: leader_on_page(d, "catalog"))
                time.sleep(args.before)
                press(d, old, "kill")
                wait_for(d, "a new catalog leader", lambda d: leader_on_page(d, "catalog") not in (None, old))
                time.sleep(8)
                press(d, old, "start")
                wait_for(d, f"{old} caught up", lambda d: replica(d, old)["state"] == "up", timeout=30)
                time.sleep(args.after)
                d.find_element(By.ID, "store-search").click()  # the storefront panel, used once
                d.find_element(By.ID, "store-item").clear()
                d.find_element(By.ID, "store-item").send_keys("2")
                d.find_element(By.ID, "store-buy").click()
                wait_for(d, "the order", lambda d: d.find_element(By.ID, "store-out").text.startswith("order "))
                d.save_screenshot(args.out)
                print(f"wrote {args.out}")
        finally:
            stop.set()
            for t in loaders:
                t.join(timeout=10)
            c.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
