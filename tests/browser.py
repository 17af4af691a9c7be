"""Headless Chromium (Debian's chromium and chromium-driver) driven by Selenium, for the
dashboard's end-to-end test. Nothing is downloaded: the driver and browser are named by
path, and Selenium Manager is kept offline."""
from __future__ import annotations

import os
import shutil
import tempfile

CHROMIUM = os.environ.get("TRAINMOVER_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("TRAINMOVER_CHROMEDRIVER", "/usr/bin/chromedriver")


def available() -> str | None:
    """None if a browser test can run here, else why not."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.exists(path) or shutil.which(path)):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


def chromium(width: int = 1400, height: int = 1600):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"      # Selenium Manager must not fetch a driver
    profile = tempfile.mkdtemp(prefix="tm-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    # this machine has no network beyond loopback: without the background-networking
    # switches Chromium keeps trying to reach its update and sync services
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
                f"--window-size={width},{height}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver._tm_profile = profile
    return driver


def close(driver) -> None:
    profile = getattr(driver, "_tm_profile", None)
    try:
        driver.quit()
    finally:
        if profile:
            shutil.rmtree(profile, ignore_errors=True)
