"""Screenshots of the app for the docs: docs/app.png (overview) and docs/app-{chat,race,lab,machine}.png.

Runs app.py's demo on the embedded model (SmolLM2-135M-Instruct + its heads), has a real chat,
a race, a small topology-lab search and the machine view in headless Debian Chromium
(Playwright, executable /usr/bin/chromium or ENTMTP_CHROMIUM), and saves each tab.

    python scripts/app_screenshots.py [--out docs]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHAT = "Explain how rainbows form, in simple words."
RACE = "Write a short poem about the sea."
TIMEOUT_MS = 900_000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from playwright.sync_api import sync_playwright

    import app
    from entmtp import ui

    _, url, _ = app.demo.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True,
                                **ui.launch_kwargs())
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=os.environ.get("ENTMTP_CHROMIUM", "/usr/bin/chromium"),
                                        headless=True, args=["--no-sandbox", "--disable-gpu"])
            pg = browser.new_page(viewport={"width": 1440, "height": 1000})
            pg.set_default_timeout(TIMEOUT_MS)
            pg.goto(url, wait_until="load")
            pg.wait_for_function("document.querySelector('#model_info')?.innerText.includes('available:')")

            pg.fill("#max_new_tokens input[type=number]", "96")
            pg.keyboard.press("Tab")
            pg.fill("#msg textarea", CHAT)
            pg.click("#send")
            pg.wait_for_function("document.querySelector('#stats')?.innerText.includes('stop: ')")
            pg.wait_for_timeout(1500)
            pg.screenshot(path=str(out / "app.png"))
            pg.screenshot(path=str(out / "app-chat.png"), full_page=True)
            print("chat:", pg.inner_text("#stats"))

            pg.get_by_role("tab", name="Race").click()
            pg.fill("#race_prompt textarea", RACE)
            pg.fill("#race_new input[type=number]", "64")
            pg.keyboard.press("Tab")
            pg.fill("#race_repeats input[type=number]", "2")
            pg.keyboard.press("Tab")
            pg.click("#race_btn")
            pg.wait_for_function("document.querySelector('#race_status')?.innerText.includes('done:')")
            pg.wait_for_timeout(1500)
            pg.screenshot(path=str(out / "app-race.png"), full_page=True)
            print("race:", pg.inner_text("#race_status"))

            pg.get_by_role("tab", name="Topology lab").click()
            pg.fill("#lab_prompts input[type=number]", "4")
            pg.keyboard.press("Tab")
            pg.fill("#lab_new input[type=number]", "16")
            pg.keyboard.press("Tab")
            pg.click("#lab_btn")
            pg.wait_for_selector("#tree_download a")
            pg.wait_for_timeout(1500)
            pg.screenshot(path=str(out / "app-lab.png"), full_page=True)
            print("lab:", pg.inner_text("#lab_status")[:300])

            pg.get_by_role("tab", name="Machine").click()
            pg.wait_for_selector("#machine_plot .js-plotly-plot")
            pg.wait_for_function("!(document.querySelector('#machine_info')?.innerText || '').includes('loading')")
            pg.wait_for_timeout(1500)
            pg.screenshot(path=str(out / "app-machine.png"), full_page=True)
            print("machine:", pg.inner_text("#machine_info")[:300])
            browser.close()
    finally:
        app.demo.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
