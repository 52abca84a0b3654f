"""The app in a real browser (Playwright + Debian Chromium): chat with a streamed draft tree,
the race, the topology lab and upload errors. Screenshots go to tests/artifacts/.

Runs on a tiny random model (fast, deterministic); needs /usr/bin/chromium. Marked `browser`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

playwright_sync = pytest.importorskip("playwright.sync_api")
CHROMIUM = os.environ.get("ENTMTP_CHROMIUM", "/usr/bin/chromium")
if not shutil.which(CHROMIUM) and not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)

from test_app_client import launched_app, needs_search, tiny_app_env  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("app_browser")
    env = tiny_app_env(root)
    # a longer context (rotary positions: nothing learned depends on it), so a 512-token reply
    # runs long enough for the Stop test on a fast machine
    cfg_path = root / "base" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = 2048
    cfg_path.write_text(json.dumps(cfg))
    with launched_app(env) as address:
        yield address, root


@pytest.fixture(scope="module")
def page(url):
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
        pg = ctx.new_page()
        pg.set_default_timeout(TIMEOUT_MS)
        failed = []
        pg.on("requestfailed", lambda r: failed.append(r.url))
        pg.goto(url[0], wait_until="load")
        # the page load loads the model and fills the pickers
        pg.wait_for_function("document.querySelector('#model_info')?.innerText.includes('available:')")
        yield pg
        external = [u for u in failed if not u.startswith(url[0].rstrip("/"))]
        assert not external, f"requests outside the app: {external}"
        browser.close()


def settle(page, ms: int = 800) -> None:
    """Let gradio drop its 'pending' dimming and plotly finish drawing before a screenshot."""
    page.wait_for_load_state("load")
    page.wait_for_timeout(ms)


def upload(page, elem: str, path: Path) -> None:
    """Put a file into a gradio File component and wait until it lists the file (the upload goes
    through the server, which on a loaded machine can take long)."""
    page.set_input_files(f"{elem} input[type=file]", str(path))
    page.wait_for_selector(f"{elem} :text('{path.name}')", timeout=3 * TIMEOUT_MS)


def plot_trace_names(page, elem_id: str) -> list[str]:
    return page.evaluate(f"""() => {{
        const gd = document.querySelector('#{elem_id} .js-plotly-plot');
        return gd && gd.data ? gd.data.map(t => t.name) : [];
    }}""")


def test_chat_streams_tree_and_strip(page):
    page.get_by_role("tab", name="Chat").click()
    page.fill("#msg textarea", "hello world, how are you?")
    page.click("#send")
    page.wait_for_selector("#strip .entmtp-tok")
    page.wait_for_function("document.querySelector('#stats')?.innerText.includes('stop:')")
    reply = page.locator("#chatbot .message-row").last.inner_text()
    assert reply.strip()
    names = plot_trace_names(page, "tree_plot")
    assert {"accepted", "rejected", "accepted edges"} <= set(names)
    acc_color = page.evaluate("""() => {
        const gd = document.querySelector('#tree_plot .js-plotly-plot');
        return gd.data.find(t => t.name === 'accepted edges').line.color; }""")
    assert acc_color == "#16a34a"
    assert page.locator("#strip .entmtp-step").count() >= 2
    assert "τ" in page.inner_text("#stats")
    assert "root entropy" in plot_trace_names(page, "step_plot")
    page.locator("#tree_plot").scroll_into_view_if_needed()
    settle(page)
    page.screenshot(path=str(ARTIFACTS / "chat.png"), full_page=True)

    # replay a step that accepted drafts: type it in the slider's box (leaving the box fires the replay)
    bars = page.evaluate("""() => {
        const gd = document.querySelector('#step_plot .js-plotly-plot');
        return gd.data.filter(t => t.type === 'bar').flatMap(t => t.x.map((x, i) => [x, t.y[i]])); }""")
    k = max(bars, key=lambda b: (b[1], -b[0]))[0]
    page.fill("#step_slider input[type=number]", str(k))
    page.keyboard.press("Tab")
    page.wait_for_selector(f"#strip .entmtp-hl[data-step='{k}']")
    page.wait_for_function(f"""() => document.querySelector('#tree_plot .js-plotly-plot')?.layout.title.text
                                .startsWith('step {k} ')""")
    settle(page)
    page.locator("#tree_plot").screenshot(path=str(ARTIFACTS / "chat_tree_accepted.png"))
    page.get_by_text("draft entropy").click()
    page.wait_for_function("""() => {
        const gd = document.querySelector('#tree_plot .js-plotly-plot');
        return gd && gd.data.some(t => t.name === 'scale' && String(t.marker.colorbar.title.text).includes('H'));
    }""")
    settle(page)
    page.locator("#tree_plot").screenshot(path=str(ARTIFACTS / "chat_tree_replay.png"))


def test_stop_button_cancels_a_reply(page):
    page.get_by_role("tab", name="Chat").click()
    page.click("#clear")
    page.wait_for_function("document.querySelector('#stats')?.innerText.trim() === ''")
    page.fill("#max_new_tokens input[type=number]", "512")
    page.keyboard.press("Tab")
    for attempt in range(4):  # the tiny model is fast: a reply may end before the click lands; then again
        page.fill("#msg textarea", f"one two three four five six seven eight nine ten {attempt}")
        page.click("#send")
        # streaming, or already finished (a fast reply can end before a poll sees 'generating')
        page.wait_for_function("/generating|stop:/.test(document.querySelector('#stats')?.innerText || '')")
        page.evaluate("document.querySelector('#stop').click()")  # at once (no actionability waits)
        page.wait_for_timeout(1500)
        stats = page.inner_text("#stats")
        if "stop:" not in stats:
            break
        page.wait_for_timeout(500)
    assert "generating" in stats and "stop:" not in stats  # no final update after the stop
    page.wait_for_timeout(1000)
    assert page.inner_text("#stats") == stats  # and no more streaming
    # the app keeps serving this session
    page.fill("#max_new_tokens input[type=number]", "8")
    page.keyboard.press("Tab")
    page.fill("#msg textarea", "hello")
    page.click("#send")
    page.wait_for_function("document.querySelector('#stats')?.innerText.includes('stop:')")


def test_race_shows_five_results(page):
    page.get_by_role("tab", name="Race").click()
    page.fill("#race_prompt textarea", "what is the capital of france?")
    page.click("#race_btn")
    page.wait_for_function("document.querySelector('#race_status')?.innerText.includes('done:')", timeout=120_000)
    assert page.locator("#race_cards .entmtp-card").count() == 5
    table = page.inner_text("#race_table")
    assert table.count("×") >= 5 and "✓" in table
    bars = page.evaluate("""() => document.querySelector('#race_plot .js-plotly-plot').data[0].y.length""")
    assert bars == 5
    settle(page)
    page.screenshot(path=str(ARTIFACTS / "race.png"), full_page=True)


@needs_search
def test_lab_frontier_download_and_bad_upload(page, url):
    root = url[1]
    calib = root / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"prompt": p}) for p in (
        "hello world, how are you today?", "the cat sat on the mat.", "what is the capital of france?",
        "paris is the capital.", "one two three four five", "how are you, world?")) + "\n")
    page.get_by_role("tab", name="Topology lab").click()
    page.wait_for_selector("#lab_btn")  # the tab has rendered: its file input will not be replaced
    upload(page, "#calib_file", calib)
    page.click("#lab_btn")
    page.wait_for_selector("#frontier .js-plotly-plot", timeout=180_000)
    page.wait_for_selector("#tree_download a")
    assert "Pareto frontier (predicted)" in plot_trace_names(page, "frontier")
    assert "lab-b4" in page.inner_text("#cand_table")
    assert page.locator("#cand_plot .js-plotly-plot").count() == 1
    with page.expect_download() as dl:
        page.locator("#tree_download a").first.click()
    doc = json.loads(Path(dl.value.path()).read_text())
    assert doc["paths"]
    settle(page)
    page.screenshot(path=str(ARTIFACTS / "lab.png"), full_page=True)

    bad = root / "bad_tree.json"
    bad.write_text('{"paths": [[0], [1, 0]]')
    upload(page, "#tree_upload", bad)
    page.click("#score_btn")
    page.wait_for_selector("#score_result .entmtp-error")
    assert "invalid JSON" in page.inner_text("#score_result")
    assert "Traceback" not in page.content()
    page.locator("#score_result").scroll_into_view_if_needed()
    settle(page)
    page.screenshot(path=str(ARTIFACTS / "lab_error.png"), full_page=True)
