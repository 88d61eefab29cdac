"""Headless Chromium for the status page's tests: find it, and dump a page's DOM after its script
has run (``--virtual-time-budget`` lets the page's fetches and timers run before the dump)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """``$ATOLL_CHROMIUM``, else the first of ``NAMES`` on the PATH."""
    named = os.environ.get("ATOLL_CHROMIUM")
    if named:
        return shutil.which(named)
    return next((path for name in NAMES if (path := shutil.which(name))), None)


def need_chromium() -> str:
    browser = find_chromium()
    if browser is None:
        pytest.skip(
            "no headless Chromium found (Debian: apt-get install chromium, as .ci/run does; "
            "or set ATOLL_CHROMIUM to a Chromium binary)"
        )
    return browser


@dataclass(frozen=True)
class Rendered:
    dom: str  # the document after its script ran, serialised as HTML
    console: list[str]  # the page's console messages (CSP violations and script errors among them)


def render(url: str, *, budget_ms: int = 5000, timeout_s: float = 90.0) -> Rendered:
    """``url`` rendered for ``budget_ms`` of the page's (virtual) time."""
    browser = need_chromium()
    with tempfile.TemporaryDirectory(prefix="atoll-chromium-") as profile:
        out = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--disable-extensions",
                f"--user-data-dir={profile}",
                "--enable-logging=stderr",
                f"--virtual-time-budget={budget_ms}",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    if out.returncode != 0 or "<html" not in out.stdout:
        raise AssertionError(f"chromium exited {out.returncode}: {out.stderr[-2000:]}")
    return Rendered(out.stdout, [line for line in out.stderr.splitlines() if ":CONSOLE" in line])
