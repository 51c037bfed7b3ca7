"""Open a report in headless Chromium and save a full-page PNG (the browser check).

Only the chromium command line is used: a first run prints the DOM of a throw-away copy of
the report whose one added script records the page's height, a second run takes the
screenshot with a window that tall. The report itself carries no script.

    python -m harness.report.screenshot REPORT.html OUT.png
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from harness.errors import ScreenshotError as ScreenshotError  # re-exported

WIDTH = 1400
MAX_HEIGHT = 16_000
"""Chromium cannot capture windows much taller; longer pages are cut there."""
_TIMEOUT = 90.0
_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_MEASURE = (
    "<script>document.body.setAttribute('data-page-height',"
    " String(document.documentElement.scrollHeight));</script>"
)


def find_chromium() -> str:
    """The browser: ``$CHROMIUM`` if set, else the first of the usual names on PATH."""
    configured = os.environ.get("CHROMIUM")
    for name in ([configured] if configured else []) + list(_CANDIDATES):
        found = shutil.which(name)
        if found:
            return found
    raise ScreenshotError(
        "no Chromium found (tried $CHROMIUM and "
        f"{', '.join(_CANDIDATES)} on PATH); on Debian: apt-get install chromium"
    )


def _chromium(browser: str, profile: Path, *args: str) -> str:
    command = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        *args,
    ]
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            out, err = process.communicate(timeout=_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the browser and its helpers, ours only
            process.communicate()
            raise ScreenshotError(f"{browser} did not finish within {_TIMEOUT:g} s") from None
    if process.returncode != 0:
        raise ScreenshotError(f"{browser} exited with {process.returncode}: {err.strip()[-2000:]}")
    return out


def page_height(browser: str, report: Path, work: Path) -> int:
    """The report's height in CSS pixels at ``WIDTH``, measured on a copy with a script."""
    source = report.read_text(encoding="utf-8")
    source = re.sub(r"<meta http-equiv=\"Content-Security-Policy\"[^>]*>", "", source)
    copy = work / "measure.html"
    copy.write_text(source.replace("</body>", _MEASURE + "</body>"), encoding="utf-8")
    dom = _chromium(
        browser,
        work / "profile-measure",
        f"--window-size={WIDTH},800",
        "--dump-dom",
        copy.as_uri(),
    )
    found = re.search(r'data-page-height="(\d+)"', dom)
    if not found:
        raise ScreenshotError(f"could not measure the height of {report}")
    return int(found.group(1))


def main(report: Path, png: Path) -> Path:
    """Save a full-page screenshot of ``report`` to ``png``; return its path."""
    if not report.is_file():
        raise ScreenshotError(f"report {str(report)!r} does not exist")
    browser = find_chromium()
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="distconf-shot-") as tmp:
        work = Path(tmp)
        height = min(page_height(browser, report.resolve(), work) + 16, MAX_HEIGHT)
        _chromium(
            browser,
            work / "profile-shot",
            f"--screenshot={png.resolve()}",
            f"--window-size={WIDTH},{height}",
            report.resolve().as_uri(),
        )
    if not png.is_file():
        raise ScreenshotError(f"chromium wrote no screenshot to {png}")
    return png


def cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("report", type=Path, help="the HTML report")
    parser.add_argument("png", type=Path, help="where to save the PNG")
    args = parser.parse_args(argv)
    try:
        print(main(args.report, args.png))
    except ScreenshotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
