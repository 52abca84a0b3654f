"""The app's Race tab with its defaults, printed as tables: the default model in the app's dtype
(`ui_common.app_dtype`), the tab's default prompt and length. Twice, unless told otherwise:

* served: `python app.py` started on a free local port, its race run as a user runs it: with
  `--via browser` (the default where Debian's chromium and playwright are installed) a headless
  chromium opens the page, which loads the model and draws the machine profile, clicks Race (the
  tab's own defaults) and prints the Machine tab's text; with `--via api` the `race` endpoint is called over HTTP (`gradio_client`);
* in-process: the same handler (`ui_race.race`) called directly in this script's main thread.

The two differ where the app's threads or the browser's load do. No asserts.

    python scripts/race_defaults.py [--repeats 1] [--max-new-tokens 64] [--only served|in-process] [--via browser|api]
"""

import argparse
import html
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the app does

ROOT = Path(__file__).resolve().parents[1]


def _text(markup) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", str(markup)))).strip()


def _print_table(headers, rows, status) -> int:
    if not rows:
        print(_text(status))
        return 1
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print(_text(status))
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHROMIUM = "/usr/bin/chromium"


def browser_available() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return os.path.exists(CHROMIUM)


def race_in_browser(url: str, timeout_ms: int = 900_000) -> int:
    """Open the app, wait for the model, click Race with the tab's defaults; print its cards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_context(viewport={"width": 1440, "height": 1000}).new_page()
        page.set_default_timeout(timeout_ms)
        page.goto(url, wait_until="load")
        page.wait_for_function("document.querySelector('#model_info')?.innerText.includes('available:')")
        page.get_by_role("tab", name="Race").click()
        page.click("#race_btn")
        page.wait_for_function("""() => (document.querySelector('#race_status')?.innerText || '').includes('done:')
                                        && document.querySelectorAll('#race_cards .entmtp-card[data-speedup]').length > 0""")
        cards = page.evaluate("""() => [...document.querySelectorAll('#race_cards .entmtp-card')].map(
            c => [c.dataset.method, c.dataset.tokensPerS, c.dataset.speedup, c.dataset.speedupOurs])""")
        status = page.inner_text("#race_status")
        page.get_by_role("tab", name="Machine").click()
        page.wait_for_function("() => !(document.querySelector('#machine_info')?.innerText || 'loading').includes('loading')")
        machine = page.inner_text("#machine_info")
        browser.close()
    print("the Machine tab, as drawn:\n" + "\n".join("    " + line for line in machine.splitlines() if line.strip()) + "\n")
    rows = [[m, f"{float(t):.1f}", f"×{float(g):.2f}", f"×{float(o):.2f}"] for m, t, g, o in cards]
    return _print_table(["method", "tok/s (median run)", "× generate", "× our loop"], rows, status)


def served(prompt: str, n_new: int, repeats: int, via: str = "api", timeout_s: float = 900.0) -> int:
    """`python app.py` in a subprocess; the race through a browser (the tab's defaults) or its HTTP API."""
    from gradio_client import Client

    port = _free_port()
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port)}
    log_path = ROOT / "runs" / "race_defaults_app.log"
    log = open(log_path, "w") if log_path.parent.is_dir() else subprocess.DEVNULL
    app = subprocess.Popen([sys.executable, str(ROOT / "app.py")], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url, client, t0 = f"http://127.0.0.1:{port}/", None, time.monotonic()
        while client is None:
            if app.poll() is not None:
                print(f"app.py exited with status {app.returncode} before serving"
                      + (f" (its output: {log_path})" if log is not subprocess.DEVNULL else ""))
                return 1
            if time.monotonic() - t0 > timeout_s:
                print(f"app.py did not serve within {timeout_s:.0f} s")
                return 1
            try:
                client = Client(url, verbose=False)
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(1.0)
        if via == "browser":
            return race_in_browser(url)
        table, _, _, status = client.predict(prompt, "default", n_new, repeats, api_name="/race")
        return _print_table(table.get("headers") or [], table.get("data") or [], status)
    finally:
        app.terminate()
        try:
            app.wait(30)
        except subprocess.TimeoutExpired:
            app.kill()
        if log is not subprocess.DEVNULL:
            log.close()


def in_process(prompt: str, n_new: int, repeats: int) -> int:
    from entmtp import ui_race
    from entmtp.ui_common import CACHE

    entry = CACHE.get("default")
    print(f"model: {entry.label}, {entry.engine.model.dtype} ({entry.dtype_why})")
    last = None
    for last in ui_race.race(prompt, "default", n_new, repeats):
        pass
    table, _, _, status = last
    return _print_table(ui_race.RACE_HEADERS, table if isinstance(table, list) else [], status)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1, help="the tab's default: 1")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="the tab's default: 64")
    ap.add_argument("--only", choices=("served", "in-process"), help="one of the two (default: both)")
    ap.add_argument("--via", choices=("browser", "api"), default=None,
                    help="how the served race is run (default: browser where chromium and playwright are installed; "
                         "a browser always runs the tab's defaults)")
    args = ap.parse_args()

    from entmtp import ui

    examples = ui._examples()
    prompt = examples[1] if len(examples) > 1 else examples[0]
    print(f"prompt: {prompt}")
    rc = 0
    if args.only in (None, "served"):
        via = args.via or ("browser" if browser_available() else "api")
        print(f"\n## served: python app.py, the race {'clicked in a headless chromium' if via == 'browser' else 'endpoint over HTTP'}")
        rc |= served(prompt, args.max_new_tokens, args.repeats, via)
    if args.only in (None, "in-process"):
        print("\n## in-process: ui_race.race called in this script's main thread")
        rc |= in_process(prompt, args.max_new_tokens, args.repeats)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
