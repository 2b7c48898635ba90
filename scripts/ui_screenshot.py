"""Take docs/status-page.png: the status page after issue 31's two-node scenario, for real.

Run from the repository root: ``.venv/bin/python scripts/ui_screenshot.py [OUT.png]``.
Needs torch (the agent and the nodes compile; about two minutes on two cores),
/usr/bin/chromium and Playwright for Python (the dev extra).

The scenario is tests/helpers/two_nodes.py, the one tests/e2e/test_operator_truth.py
checks: a real server with admin/write/read tokens, a real agent round (the site's
two-rank torchrun job as a ``[[command]]``, an ``[[attention]]`` workload, a command the
builder does not allow), a second round from another shell, then two training nodes
(prejob with the ranks' ``OMP_NUM_THREADS``, the torchrun job, postjob). The page is then
shown to the admin token, as an operator opens it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.helpers, from the repo

from cachekeeper.server.settings import Settings  # noqa: E402
from tests.helpers.live_server import start_server  # noqa: E402
from tests.helpers.two_nodes import ADMIN, TOKENS, run_scenario  # noqa: E402


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with start_server(Settings(data_dir=root / "server", tokens=TOKENS)) as live:
            done = run_scenario(live.url, root)
            for node in done.nodes:
                print(f"{node.name}: {node.prejob.strip()}")
                print(f"{node.name}: {node.postjob.strip()}")
            with sync_playwright() as p:
                browser = p.chromium.launch(
                    executable_path="/usr/bin/chromium", args=["--no-sandbox"]
                )
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(f"{live.url}/")
                page.fill("input[name=token]", ADMIN)
                page.click("#login button")
                page.wait_for_selector("#matrix")
                page.screenshot(path=str(out), full_page=True)
                browser.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/status-page.png"))
