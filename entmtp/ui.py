"""The Gradio app: Chat, Race, Topology lab and Machine views over one shared engine cache.

`build_demo()` only builds the Blocks: no model is loaded until a handler needs one (or
`warm_up()` is called, e.g. in a background thread at launch), so importing the app is fast.
The views live in `ui_chat`, `ui_race`, `ui_lab` and `ui_machine`; what they share (limits,
errors, the model cache, methods and trees) in `ui_common`.

Configuration (environment):
* ENTMTP_APP_MODEL: the app's default base model ("default" = the embedded SmolLM2-135M-Instruct,
  or a local directory / repo id chosen by whoever runs the server).
* ENTMTP_APP_HEADS: heads of that model, "medusa=/path,hydra=/path,hydra++=/path" (default: the
  embedded heads under assets/heads/ that exist).
* ENTMTP_APP_DTYPE: float32 or bfloat16 (default: the fastest dtype in which speculation is
  lossless on this machine, measured at load; see `ui_common.app_dtype`).
* ENTMTP_APP_CACHE: how many models the engine cache keeps (LRU, default 2).
* ENTMTP_APP_ALLOW_HUB: "0" forbids loading other Hugging Face repo ids from the browser.
* ENTMTP_APP_STOCK_PROCESS: "0" times `generate` in the app's own process rather than in a worker
  holding a second copy of the model (for small Spaces; the Race then says where it ran).
* ENTMTP_TUNE: "0" skips the self-tuning (the Machine view then says "not measured").

Nothing is fetched from outside at page load: the theme uses the system's fonts, plotly and
every other asset come with gradio, and analytics are off.
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from . import viz  # noqa: E402
from .compute_thread import COMPUTE  # noqa: E402
from .ui_chat import chat, chat_waiting, clear_chat, replay, stop_chat  # noqa: E402,F401
from .ui_common import (CACHE, CHAT_MAX_NEW_TOKENS, DEFAULT_METHOD, DEFAULT_TREE, HEAD_METHODS, HUB_FALLBACK,  # noqa: E402,F401
                        LAB_BUDGETS, LAB_DEFAULT_BUDGETS, LAB_MAX_NEW_TOKENS, LAB_MAX_PROMPTS, RACE_MAX_NEW_TOKENS,
                        UPLOAD_MAX_BYTES, UPLOAD_TYPES, AppError, EngineCache, LoadedModel, _error_md,
                        check_model_key, error_message, load_model, method_choices, method_scheduler, method_status,
                        model_choices, model_info_md, scheduler_names, session_state, tree_choices, warm_up)
from .ui_lab import (LAB_HEADERS, _first_heads, _search_module, lab_check_upload, lab_heads_choices,  # noqa: E402
                     lab_score, lab_search, lab_select)
from .ui_machine import machine_view  # noqa: E402
from .ui_race import RACE_HEADERS, RACE_MAX_REPEATS, race, race_waiting  # noqa: E402


def load_model_ui(model_key, method, request: gr.Request = None):
    """Load (or look up) a model; report what it can do; refresh the pickers (a method that
    this model cannot run is replaced by the best one it can). A model that fails to load is
    not kept: the picker returns to the last model that loaded."""
    state = session_state(request)
    try:
        key = check_model_key(model_key)
        entry = CACHE.get(key)
    except Exception as exc:  # noqa: BLE001
        msg = error_message(exc)
        back = state.get("model") or "default"
        return (_error_md(f"cannot load {str(model_key)[:80]}: {msg} (back to the last model that loaded)"),
                gr.Dropdown(value=back), gr.Dropdown(), gr.Dropdown(), gr.Dropdown(), gr.Dropdown())
    state["model"] = key
    st = method_status(entry)
    if method not in st or st[method] is not None:
        method = next((m for m in (DEFAULT_METHOD, "hydra++", "hydra", "medusa", "baseline") if st[m] is None), "baseline")
    return (model_info_md(entry), gr.Dropdown(value=key), gr.Dropdown(choices=method_choices(entry), value=method),
            gr.Dropdown(choices=tree_choices(state["trees"], entry, method)), scheduler_for(method, entry),
            gr.Dropdown(choices=lab_heads_choices(entry), value=_first_heads(entry)))


def scheduler_for(method: str, entry=None):
    """The scheduler picker as `method` runs: its own scheduler shown (entmtp without an entropy
    bank for its heads runs a static tree, and says so); no choice for plain decoding."""
    from .ui_common import entropy_bank_problem

    if method == "baseline":
        return gr.Dropdown(choices=scheduler_names(), value="static", interactive=False,
                           info="plain decoding drafts no tree")
    name = method_scheduler(method)
    if name == "entropy" and entry is not None and entropy_bank_problem(entry) is not None:
        return gr.Dropdown(choices=scheduler_names(), value="static", interactive=True,
                           info="no entropy bank for these heads: a static tree")
    return gr.Dropdown(choices=scheduler_names(), value=name, interactive=True,
                       info="each step's tree picked by the draft's entropy" if name == "entropy" else None)


def method_changed(method, model_key, request: gr.Request = None):
    """The scheduler and tree pickers follow the method: its scheduler, its heads' recommended tree."""
    state = session_state(request)
    entry = CACHE.peek(state.get("model") or "default")
    return scheduler_for(method, entry), gr.Dropdown(choices=tree_choices(state["trees"], entry, method))


CSS = """
.gradio-container { max-width: 1500px !important; }
#title h1 { margin-bottom: 0; }
.entmtp-error { color: #b91c1c; background: #fef2f2; border: 1px solid #fecaca; border-radius: 6px;
                padding: 6px 10px; margin: 4px 0; }
.entmtp-notice { color: #92400e; background: #fffbeb; border: 1px solid #fde68a; border-radius: 6px;
                 padding: 4px 10px; margin: 4px 0; font-size: 13px; }
.entmtp-notice-inline { color: #92400e; }
.entmtp-stats { font-size: 14px; padding: 4px 2px; }
.entmtp-model { font-size: 13px; line-height: 1.55; padding: 8px 12px; border: 1px solid #e5e7eb; border-radius: 8px;
                background: #f9fafb; }
.entmtp-muted { color: #6b7280; }
.entmtp-ok { color: #15803d; font-weight: 600; font-size: 12px; }
.entmtp-diff { color: #b45309; font-weight: 600; font-size: 12px; }
.entmtp-race { display: grid; grid-template-columns: repeat(auto-fit, minmax(180px, 1fr)); gap: 10px; }
.entmtp-card { border: 1px solid #e5e7eb; border-radius: 8px; padding: 8px 10px; background: #fafafa; }
.entmtp-card-h { margin-bottom: 6px; font-size: 14px; }
.entmtp-card-h .entmtp-muted { font-size: 12px; }
.entmtp-card-b { white-space: pre-wrap; font-size: 13px; max-height: 260px; overflow-y: auto; }
.entmtp-score { margin-top: 8px; font-size: 13px; }
.entmtp-score td, .entmtp-score th { padding: 2px 10px; text-align: left; }
.entmtp-why details { font-size: 13px; margin: 2px 0; }
#strip { min-height: 60px; }
"""

INTRO = """# Tree speculative decoding, step by step
Draft heads (Medusa, Hydra, Hydra++) propose a **tree** of next tokens; the base model checks the whole tree in
**one forward** and keeps the longest agreeing path. **τ** = tokens per base forward (1.0 for plain decoding).
Everything runs on this machine, tuned for it at load (see the Machine tab)."""

SYSTEM_FONTS = ["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "Roboto", "sans-serif"]
MONO_FONTS = ["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"]


QUEUE_POLL_S = 0.02  # how often an idle event queue looks for work (gradio's own: every 1 ms)


def serve_queue(demo: gr.Blocks) -> gr.Blocks:
    """`demo.queue` with the app's limits, its idle queue polled every `QUEUE_POLL_S`: gradio's
    1 ms poll wakes the server thread a thousand times a second, and each wake takes the GIL from
    the compute thread in the middle of a decoding step (docs/performance.md, "One thread runs the
    models"). An event waits at most 20 ms more to start."""
    demo.queue(default_concurrency_limit=2, max_size=64)
    queue = getattr(demo, "_queue", None)
    if queue is not None and isinstance(getattr(queue, "sleep_when_free", None), (int, float)):
        queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
    else:
        warnings.warn("gradio's queue has no sleep_when_free: it polls at its own rate", stacklevel=2)
    return demo


def launch_kwargs() -> dict:
    """theme / css / limits: Gradio 6 takes them in `launch()`. The theme names system fonts
    only (the stock themes fetch web fonts from outside, which an offline page waits on)."""
    theme = gr.themes.Soft(primary_hue="green", neutral_hue="slate", font=SYSTEM_FONTS, font_mono=MONO_FONTS)
    return dict(theme=theme, css=CSS, ssr_mode=False, max_file_size=UPLOAD_MAX_BYTES, show_error=False)


def _examples() -> list[str]:
    try:
        from .data import bundled_prompts

        lines = bundled_prompts("chat_examples").read_text(encoding="utf-8").splitlines()
        return [ln.strip() for ln in lines if ln.strip()][:8]
    except Exception:  # noqa: BLE001
        return ["Explain how rainbows form, in simple words."]


def _chat_view(examples):
    """The Chat tab's components (see `build_demo` for the events)."""
    c = {}
    with gr.Row():
        with gr.Column(scale=3):
            c["chatbot"] = gr.Chatbot(label="chat", height=380, elem_id="chatbot", buttons=["copy"])
            with gr.Row():
                c["msg"] = gr.Textbox(placeholder="Ask something… (Enter to send)", show_label=False, scale=5,
                                      lines=1, max_lines=6, elem_id="msg")
                c["send"] = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="send")
                c["stop"] = gr.Button("Stop", variant="stop", scale=1, min_width=70, elem_id="stop")
                c["clear"] = gr.Button("Clear", scale=1, min_width=70, elem_id="clear")
            gr.Examples(examples=[[e] for e in examples], inputs=[c["msg"]], label="examples")
        with gr.Column(scale=2):
            c["method"] = gr.Dropdown(choices=method_choices(None), value=DEFAULT_METHOD, label="method",
                                      elem_id="method")
            c["tree"] = gr.Dropdown(choices=tree_choices(), value=DEFAULT_TREE, label="draft tree", elem_id="tree",
                                    info="this run's lab trees, the tree recommended for this machine, reference trees")
            c["sched"] = gr.Dropdown(choices=scheduler_names(), value=method_scheduler(DEFAULT_METHOD),
                                     label="tree scheduler", elem_id="scheduler")
            c["temperature"] = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="temperature (0 = greedy)",
                                         elem_id="temperature")
            c["top_p"] = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p", elem_id="top_p")
            c["max_new"] = gr.Slider(1, CHAT_MAX_NEW_TOKENS, value=128, step=1, label="max new tokens",
                                     elem_id="max_new_tokens")
            c["stats"] = gr.HTML("", elem_id="stats")
            c["notices"] = gr.HTML("", elem_id="notices")
    with gr.Row(equal_height=True):
        c["color_by"] = gr.Radio([("draft probability", "draft_prob"), ("draft entropy", "draft_entropy")],
                                 value="draft_prob", label="node colour", scale=1, elem_id="color_by")
        c["slider"] = gr.Slider(0, 1, value=0, step=1, label="replay step", interactive=False, scale=3,
                                elem_id="step_slider")
    c["tree_plot"] = gr.Plot(value=viz.empty_figure("the draft tree of each step appears here"),
                             label="draft tree of the step (green = accepted path, ◆ = bonus token, "
                                   "▼ = copied from the context by prompt lookup)", elem_id="tree_plot")
    with gr.Row():
        with gr.Column(scale=3):
            c["strip"] = gr.HTML("", label="tokens by step", elem_id="strip")
        with gr.Column(scale=2):
            c["step_plot"] = gr.Plot(value=viz.step_chart_figure([]), label="per step", elem_id="step_plot")
    return c


def _race_view(examples):
    c = {}
    gr.Markdown("One prompt through transformers' `generate` (greedy), our plain loop and every speculative "
                "method the loaded heads allow (Medusa, Hydra, Hydra++, entmtp), "
                "each timed alike: the bench's runner called in the worker, nothing else inside the timed window, "
                "after an untimed warm-up of every method; with repeats the order rotates per round and the table "
                "keeps each method's median run. **× our loop** and **× generate** are tokens/s ratios; ✓ marks "
                f"outputs token-identical to the reference. At most {RACE_MAX_NEW_TOKENS} new tokens.")
    with gr.Row():
        c["prompt"] = gr.Textbox(value=examples[1] if len(examples) > 1 else "", label="prompt", scale=4, lines=2,
                                 elem_id="race_prompt")
        with gr.Column(scale=1):
            c["new"] = gr.Slider(8, RACE_MAX_NEW_TOKENS, value=64, step=8, label="max new tokens", elem_id="race_new")
            c["repeats"] = gr.Slider(1, RACE_MAX_REPEATS, value=1, step=1, label="repeats (interleaved)",
                                     elem_id="race_repeats")
            c["btn"] = gr.Button("Race", variant="primary", elem_id="race_btn")
    c["status"] = gr.HTML("", elem_id="race_status")
    c["table"] = gr.Dataframe(headers=RACE_HEADERS, label="results", interactive=False, elem_id="race_table",
                              wrap=True, column_widths=["28%", "7%", "9%", "10%", "6%", "10%", "10%", "10%", "10%"])
    c["plot"] = gr.Plot(value=viz.race_bar_figure([]), label="tokens/s", elem_id="race_plot")
    c["cards"] = gr.HTML("", elem_id="race_cards")
    return c


def _lab_view(lab_why):
    c = {}
    gr.Markdown("Search draft-tree topologies for *your* prompts: statistics from a calibration file, "
                "a greedy search per node budget, **predicted τ** on the calibration prompts and "
                "**measured τ** on held-out ones (25%; 50% when racing small trees on-policy). Step latency comes "
                "from this machine's tuned profile (or is measured once, then reused). Limits here: "
                f"{LAB_MAX_PROMPTS} prompts, {LAB_MAX_NEW_TOKENS} new tokens per prompt, budgets up to "
                f"{max(LAB_BUDGETS)} nodes, uploads up to {UPLOAD_MAX_BYTES // (1024 * 1024)} MB "
                f"({', '.join(UPLOAD_TYPES)}).")
    gr.HTML(_error_md(lab_why) if lab_why else "", elem_id="lab_unavailable")
    with gr.Row():
        with gr.Column(scale=2):
            # no file_types filter: a refused file reaches the server, which says why and blocks the search
            c["calib"] = gr.File(label="calibration prompts (.json / .jsonl / .txt)", elem_id="calib_file", height=120)
            c["use_example"] = gr.Checkbox(value=True, label="use the bundled example (calib_example.jsonl) "
                                           "when no file is uploaded", elem_id="use_example")
        with gr.Column(scale=2):
            c["heads"] = gr.Dropdown(choices=lab_heads_choices(None), value="hydra", label="heads", elem_id="lab_heads")
            c["budgets"] = gr.CheckboxGroup(choices=list(LAB_BUDGETS), value=list(LAB_DEFAULT_BUDGETS),
                                            label="node budgets", elem_id="budgets")
        with gr.Column(scale=1):
            c["prompts"] = gr.Slider(2, LAB_MAX_PROMPTS, value=8, step=1, label="max prompts (search and score)",
                                     elem_id="lab_prompts")
            c["new"] = gr.Slider(8, LAB_MAX_NEW_TOKENS, value=32, step=8, label="new tokens per prompt",
                                 elem_id="lab_new")
            c["race"] = gr.Checkbox(value=False, label="race small trees on-policy (slower; for noisy CPUs whose "
                                    "step times cannot rank them)", elem_id="lab_race")
            c["btn"] = gr.Button("Run search", variant="primary", elem_id="lab_btn", interactive=lab_why is None)
    c["status"] = gr.HTML("", elem_id="lab_status")
    with gr.Row():
        c["frontier"] = gr.Plot(value=viz.empty_figure("run the search to see the frontier"),
                                label="nodes vs τ: predicted frontier, held-out measurements (×)", elem_id="frontier")
        c["heldout"] = gr.Plot(value=viz.empty_figure("run the search to see the frontier"),
                               label="nodes vs tokens/s: predicted frontier, held-out measurements (×)",
                               elem_id="heldout")
    c["table"] = gr.Dataframe(headers=LAB_HEADERS, label="chosen trees (best per budget) and the reference; "
                              "speedup = held-out tokens/s over plain decoding", interactive=False,
                              elem_id="cand_table", wrap=False, max_height=420)
    with gr.Row():
        with gr.Column(scale=3):
            c["cand"] = gr.Dropdown(choices=[], label="candidate tree", elem_id="cand_tree")
            c["cand_plot"] = gr.Plot(value=viz.empty_figure("the selected tree is drawn here"), label="selected tree",
                                     elem_id="cand_plot")
        with gr.Column(scale=1):
            c["file"] = gr.File(label="tree JSON (download)", interactive=False, elem_id="tree_download")
    gr.Markdown("### Score a tree\nUpload a tree JSON (a list of rank paths, or an object with `paths`): its τ and "
                "tokens/s are predicted from a statistics pass and measured by decoding (greedy, on at most "
                "*max prompts* of the calibration prompts above), next to plain decoding; it then becomes "
                "selectable in the chat tab.")
    with gr.Row():
        c["tree_up"] = gr.File(label="tree JSON", file_types=[".json"], elem_id="tree_upload", height=120, scale=1)
        with gr.Column(scale=2):
            c["score_btn"] = gr.Button("Score tree", elem_id="score_btn")
            c["score_md"] = gr.HTML("", elem_id="score_result")
    c["score_plot"] = gr.Plot(value=viz.empty_figure("the uploaded tree is drawn here", 240), label="uploaded tree",
                              elem_id="score_plot")
    return c


def _machine_view():
    c = {}
    gr.Markdown("What entmtp measured on this machine at load, once, and chose from it (the same profile as "
                "`entmtp tune`): the kernel sets tried and their latency by tree rows, whether tree rows are "
                "bitwise one-row steps (then speculation is exactly lossless), the threads, the dtype, and the "
                "tree per heads chosen from the heads' shipped acceptance statistics with this machine's latency.")
    c["btn"] = gr.Button("Show the profile", size="sm", elem_id="machine_refresh")
    c["info"] = gr.HTML("<div class='entmtp-model'>loading the profile…</div>", elem_id="machine_info")
    c["plot"] = gr.Plot(value=viz.empty_figure("the latency curve appears here"), label="latency vs tree rows",
                        elem_id="machine_plot")
    return c


def build_demo() -> gr.Blocks:
    """The app's Blocks. Loads no model (see `warm_up`)."""
    examples = _examples()
    _, lab_why = _search_module()
    with gr.Blocks(title="entmtp · tree speculative decoding") as demo:
        gr.Markdown(INTRO, elem_id="title")
        with gr.Row(elem_id="model_row"):
            with gr.Column(scale=2, min_width=280):
                model_dd = gr.Dropdown(choices=model_choices(), value="default", label="model", allow_custom_value=True,
                                       info="the embedded model, or type a Hugging Face repo id (owner/name): "
                                            "baseline only, and it must fit this machine", elem_id="model")
                load_btn = gr.Button("Load model", size="sm", elem_id="load_model")
            with gr.Column(scale=3):
                model_md = gr.HTML("<div class='entmtp-model'>loading the model…</div>", elem_id="model_info")

        with gr.Tabs():
            with gr.Tab("Chat", id="chat"):
                ch = _chat_view(examples)
            with gr.Tab("Race", id="race"):
                rc = _race_view(examples)
            with gr.Tab("Topology lab", id="lab"):
                lb = _lab_view(lab_why)
            with gr.Tab("Machine", id="machine"):
                mc = _machine_view()

        # ---------------- events
        # handlers that run a model run on the one compute thread (`compute_thread`: one OpenMP
        # team per process); the others (pickers, replay, Stop, Clear) run in gradio's workers
        on_compute = COMPUTE.wrap
        load_on_compute = on_compute(load_model_ui, "loading a model")
        machine_on_compute = on_compute(machine_view, "the machine profile")
        chat_on_compute = on_compute(chat, "a chat reply", chat_waiting)
        pickers = [model_md, model_dd, ch["method"], ch["tree"], ch["sched"], lb["heads"]]
        load_btn.click(load_on_compute, [model_dd, ch["method"]], pickers, api_name="load_model",
                       concurrency_id="load", concurrency_limit=2)
        demo.load(load_on_compute, [model_dd, ch["method"]], pickers, api_visibility="private",
                  concurrency_id="load").then(machine_on_compute, [model_dd], [mc["info"], mc["plot"]],
                                              api_visibility="private")
        ch["method"].input(method_changed, [ch["method"], model_dd], [ch["sched"], ch["tree"]],
                           api_visibility="private", concurrency_limit=None)

        chat_in = [ch["msg"], ch["chatbot"], model_dd, ch["method"], ch["tree"], ch["sched"], ch["temperature"],
                   ch["top_p"], ch["max_new"], ch["color_by"]]
        chat_out = [ch["chatbot"], ch["msg"], ch["tree_plot"], ch["strip"], ch["step_plot"], ch["stats"],
                    ch["notices"], ch["slider"]]
        ch["send"].click(chat_on_compute, chat_in, chat_out, api_name="chat", concurrency_id="gen", concurrency_limit=2)
        ch["msg"].submit(chat_on_compute, chat_in, chat_out, api_visibility="private", concurrency_id="gen")
        # Stop and Clear reach the running reply itself (ui_chat.RUNS): it ends at its next step
        ch["stop"].click(stop_chat, None, None, api_visibility="private", concurrency_limit=None)
        ch["clear"].click(clear_chat, None, [ch["chatbot"], ch["tree_plot"], ch["strip"], ch["step_plot"],
                                                ch["stats"], ch["notices"], ch["slider"]],
                          api_name="clear", concurrency_limit=None)
        replay_out = [ch["tree_plot"], ch["strip"], ch["step_plot"]]
        # input: typing a number in the slider's box; release: dragging (not change: the reply's own
        # updates of the slider would redraw too, with a stale value after Clear)
        ch["slider"].input(replay, [ch["slider"], ch["color_by"]], replay_out, api_name="replay",
                           concurrency_limit=None)
        ch["slider"].release(replay, [ch["slider"], ch["color_by"]], replay_out, api_visibility="private",
                             concurrency_limit=None)
        ch["color_by"].input(replay, [ch["slider"], ch["color_by"]], replay_out, api_visibility="private",
                             concurrency_limit=None)

        rc["btn"].click(on_compute(race, "a race", race_waiting), [rc["prompt"], model_dd, rc["new"], rc["repeats"]],
                        [rc["table"], rc["plot"], rc["cards"], rc["status"]], api_name="race", concurrency_id="race", show_progress="hidden",
                        concurrency_limit=1)

        lb["calib"].upload(lab_check_upload, [lb["calib"]], [lb["status"]], api_visibility="private",
                           concurrency_limit=None)
        lb["btn"].click(on_compute(lab_search, "a topology-lab search"), [lb["calib"], lb["use_example"], model_dd, lb["heads"], lb["budgets"], lb["prompts"],
                                     lb["new"], lb["race"]],
                        [lb["status"], lb["frontier"], lb["heldout"], lb["table"], lb["cand"], lb["cand_plot"],
                         lb["file"], ch["tree"]], api_name="lab_search", concurrency_id="lab", concurrency_limit=1)
        lb["cand"].input(lab_select, [lb["cand"]], [lb["cand_plot"], lb["file"]], api_name="lab_select",
                         concurrency_limit=None)
        lb["score_btn"].click(on_compute(lab_score, "a tree score"), [lb["tree_up"], lb["calib"], lb["use_example"], model_dd, lb["heads"],
                                          lb["prompts"], lb["new"]],
                              [lb["score_md"], lb["score_plot"], ch["tree"]], api_name="lab_score",
                              concurrency_id="lab")
        mc["btn"].click(machine_on_compute, [model_dd], [mc["info"], mc["plot"]], api_name="machine", concurrency_limit=None)
    return demo
