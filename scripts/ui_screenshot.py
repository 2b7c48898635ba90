"""Take docs/status-page.png: the status page of a real server holding the tests' data.

Run from the repository root: ``.venv/bin/python scripts/ui_screenshot.py [OUT.png]``.
Needs /usr/bin/chromium and Playwright for Python (the dev extra).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.helpers, from the repo

from cachekeeper.server.settings import Settings  # noqa: E402

from tests.helpers.live_server import start_server  # noqa: E402
from tests.helpers.ui_data import TOKENS, seed  # noqa: E402


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with start_server(Settings(data_dir=Path(tmp), tokens=TOKENS)) as live:
            seed(live.url)
            with sync_playwright() as p:
                browser = p.chromium.launch(
                    executable_path="/usr/bin/chromium", args=["--no-sandbox"]
                )
                page = browser.new_page(viewport={"width": 1180, "height": 900})
                page.goto(f"{live.url}/")
                page.fill("input[name=token]", "admin-token-1")
                page.click("#login button")
                page.wait_for_selector("#matrix")
                page.screenshot(path=str(out), full_page=True)
                browser.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/status-page.png"))
