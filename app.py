"""entmtp web app: chat with a draft tree drawn per step, a fair side-by-side race, a topology lab,
and the profile this machine was tuned to.

Run `python app.py` (Hugging Face Spaces runs this file too). Building `demo` loads no model:
the default model is loaded in a background thread at launch, or on first use.
Environment: see `entmtp/ui.py` (ENTMTP_APP_MODEL, ENTMTP_APP_HEADS, ENTMTP_APP_CACHE, ...).
"""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from entmtp import ui  # noqa: E402

demo = ui.build_demo()
ui.serve_queue(demo)

if __name__ == "__main__":
    import threading

    threading.Thread(target=ui.warm_up, name="entmtp-warm-up", daemon=True).start()
    demo.launch(**ui.launch_kwargs())
