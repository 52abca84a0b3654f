"""The app's Race tab with its defaults, in-process, printed as a table: the default model in the
app's dtype (`ui_common.app_dtype`), the tab's default prompt and length; the same code path as the
button (`ui_race.race`), without a browser. No asserts.

    python scripts/race_defaults.py [--repeats 1] [--max-new-tokens 64]
"""

import argparse
import html
import re

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the app does


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1, help="the tab's default: 1")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="the tab's default: 64")
    args = ap.parse_args()

    from entmtp import ui, ui_race
    from entmtp.ui_common import CACHE

    examples = ui._examples()
    prompt = examples[1] if len(examples) > 1 else examples[0]
    entry = CACHE.get("default")
    print(f"model: {entry.label}, {entry.engine.model.dtype} ({entry.dtype_why})")
    print(f"prompt: {prompt}")
    last = None
    for last in ui_race.race(prompt, "default", args.max_new_tokens, args.repeats):
        pass
    table, _, _, status = last
    if not isinstance(table, list) or not table:
        print(html.unescape(re.sub(r"<[^>]+>", " ", str(status))).strip())
        return 1
    print("| " + " | ".join(ui_race.RACE_HEADERS) + " |")
    print("|" + "---|" * len(ui_race.RACE_HEADERS))
    for row in table:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print(html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", str(status)))).strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
