"""Build real-conversation prompt files: a TRAINING file and the held-out evaluation set.

Commands (from the repository root, in the venv; the evaluation set is committed as
``entmtp/prompts/heldout_chat.jsonl`` and rebuilt bit for bit by the second command):

    python scripts/build_chat_prompts.py train --out runs/train_chat.jsonl --n 4000 --seed 0 \\
        --exclude runs/calib_prompts.jsonl
    python scripts/build_chat_prompts.py heldout --out entmtp/prompts/heldout_chat.jsonl

What users send a chat model is not one templated instruction: it is a turn of a conversation,
often short, often not in English, often following earlier turns. The sources here (offline, from
package registries, read as files, never imported):

* ``chitchat`` -- ``chitchat-dataset`` (MIT): 7,168 human-human conversations. A prompt is a run of
  1-4 consecutive turns ending on one speaker's turn (that speaker is the user, the other the
  assistant), so multi-turn context is what the model answers.
* ``chatterbot`` -- ``chatterbot-corpus`` (BSD-3-Clause): question/answer dialogues in 27
  languages; a prompt is a dialogue cut before one of its answers (1-3 turns of context).
* ``generated`` -- the instruction templates of ``build_train_prompts.py`` (code, math, writing,
  explanations, advice, role-play openers ...): training only.
* ``written`` -- ``HELDOUT_WRITTEN`` below, written for this project in the way people type
  requests (typos, context, follow-ups); evaluation only, never trained on.

Held out by construction: every conversation (chitchat: its id; chatterbot: its file and first
line) hashes into one of 8 buckets, and bucket 0 is never used for training, whatever the seed or
size; the evaluation set draws only from bucket 0. Every file also excludes the bench prompts and
the app's calibration example (exact and 8-word-shingle matches), plus ``--exclude`` files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_train_prompts import (HELD_OUT_FILES, chitchat_data, generated_prompts,  # noqa: E402
                                 load_held_out, normalize, package_dir)

HELDOUT_BUCKETS = 8  # bucket 0 of sha256(conversation key) is the evaluation pool
TRAIN_SHARE = {"chitchat": 0.35, "chatterbot": 0.15}  # of --n; generated prompts fill the rest
MAX_WORDS = 160  # whole prompt, all turns
# the evaluation's non-English dialogues: languages with many speakers that the base model was
# trained on at least a little (training takes every language of the corpus)
EVAL_LANGUAGES = ("french", "spanish", "german", "portuguese", "italian", "russian", "chinese", "japanese")

# Written for this project (Apache-2.0): requests as people type them to a chat assistant.
HELDOUT_WRITTEN = [
    ("code", "how do i reverse a list in python without changing the original one"),
    ("code", "My JavaScript fetch call returns a Promise instead of the data. What am I doing wrong?"),
    ("code", "write a bash one-liner that counts how many .txt files are in a folder and its subfolders"),
    ("code", "Can you explain what this SQL does? SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 3"),
    ("math", "If I save 45 dollars a week, how long until I have 1000? Show the steps please."),
    ("math", "whats the derivative of x^2 * sin(x)"),
    ("writing", "Write a short, friendly message to my landlord asking if I can paint the living room."),
    ("writing", "give me 5 catchy names for a small bakery that sells sourdough"),
    ("writing", "Can you make this sound more professional: hey, i cant make the meeting, something came up, sorry"),
    ("advice", "I keep procrastinating on my thesis. Any practical tips that actually work?"),
    ("advice", "my cat stopped eating dry food suddenly, should I be worried?"),
    ("roleplay", "Pretend you are a pirate captain and tell me about your latest adventure."),
    ("roleplay", "Let's play a game: you are a librarian and I am looking for a good mystery novel."),
    ("explain", "explain like I'm five: why is the sky blue?"),
    ("code", "I get 'TypeError: unsupported operand type(s) for +: 'int' and 'str'' in my Python script when I do "
             "total = total + line. The lines come from a file. How do I fix it?"),
    ("code", "Write a Python function that takes a list of dictionaries with 'name' and 'age' keys and returns "
             "the names of everyone older than 30, sorted alphabetically."),
    ("code", "what's the difference between git merge and git rebase? when should I use each"),
    ("code", "Convert this to JSON please: name Anna, age 29, languages English and Spanish, city Madrid"),
    ("math", "A train leaves at 3:45 pm and the trip takes 2 hours 50 minutes. When does it arrive?"),
    ("math", "Is 221 a prime number? Explain how you check."),
    ("writing", "Write a four-line poem about Monday mornings and coffee."),
    ("writing", "I need a cover letter opening paragraph for a junior data analyst job. I just finished a "
                "statistics degree and did an internship at a bank."),
    ("writing", "Give me an outline for a 5-paragraph essay on whether homework should be banned."),
    ("summarize", "Summarize this in one sentence: The city council voted on Tuesday to extend the bike lane "
                  "network by 40 kilometres over the next three years. Supporters said it would cut traffic and "
                  "pollution, while some shop owners worried about losing parking spaces in front of their stores."),
    ("advice", "How can I get better sleep? I usually go to bed at 1am and wake up tired."),
    ("advice", "I'm 25 and want to start investing but I know nothing about it. Where do I begin?"),
    ("advice", "my best friend forgot my birthday and i feel hurt. should i say something or let it go?"),
    ("planning", "Plan a 3-day trip to Rome for someone who loves food and history, on a budget."),
    ("planning", "Can you make me a simple weekly meal plan for a vegetarian who doesn't like cooking much?"),
    ("knowledge", "Why did the Roman Empire fall? Give me the main reasons."),
    ("knowledge", "How does a vaccine train the immune system?"),
    ("brainstorm", "I'm bored on a Saturday with no money. Give me ideas."),
    ("brainstorm", "What are some good names for a golden retriever puppy?"),
    ("translation", "How do you say 'where is the train station, please?' in French and German?"),
    ("roleplay", "You are a strict but kind fitness coach. I just told you I skipped the gym all week. Respond."),
    ("comparison", "iPhone or Android for my mom who is 70 and not very good with technology?"),
]
# Two-turn requests: a follow-up after an earlier exchange (the earlier answer written for this project).
HELDOUT_WRITTEN_FOLLOWUPS = [
    ("followup", ["What is a good beginner houseplant?",
                  "A pothos is a great choice: it tolerates low light, needs water only when the top of the soil "
                  "is dry, and grows quickly.",
                  "How often should I water it in winter?"]),
    ("followup", ["Write a haiku about the ocean.",
                  "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time.",
                  "Nice! Now one about the mountains."]),
    ("followup", ["What does HTTP 404 mean?",
                  "HTTP 404 means Not Found: the server was reached, but it has nothing at the requested address.",
                  "and what about 500?"]),
]


def bucket(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:4], "big") % HELDOUT_BUCKETS


def clean(text: str) -> str:
    return " ".join(str(text).split())


def messages_from_turns(turns: list[str]) -> list[dict]:
    """Alternate roles backwards from the last turn, which is the user's."""
    n = len(turns)
    return [{"role": "user" if (n - 1 - i) % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


def words(turns: list[str]) -> int:
    return sum(len(t.split()) for t in turns)


def chitchat_conversations() -> list[tuple[str, list[str]]]:
    """(key, turns): each conversation's turns, consecutive messages of one sender joined."""
    data = chitchat_data()
    out = []
    for key in sorted(data):
        turns = []
        for group in data[key].get("messages") or []:
            text = clean(" ".join(m.get("text") or "" for m in group if isinstance(m, dict)))
            if text:
                turns.append(text)
        if len(turns) >= 1:
            out.append((f"chitchat:{key}", turns))
    return out


def chatterbot_conversations() -> list[tuple[str, str, list[str]]]:
    """(key, language, turns) of every dialogue of every language."""
    directory = package_dir("chatterbot_corpus")
    if directory is None:
        print("note: chatterbot-corpus is not installed; skipping it (pip install chatterbot-corpus)")
        return []
    import yaml

    out = []
    for path in sorted((directory / "data").glob("*/*.yml")):
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError:
            continue  # a few files of the corpus do not parse; they are skipped whole
        for dialogue in doc.get("conversations") or []:
            if isinstance(dialogue, list) and dialogue and all(isinstance(t, str) for t in dialogue):
                turns = [clean(t) for t in dialogue if clean(t)]
                if turns:
                    key = f"chatterbot:{path.parent.name}/{path.stem}:{normalize(turns[0])}"
                    out.append((key, path.parent.name, turns))
    return out


def chitchat_prompt(turns: list[str], rng: random.Random) -> list[str] | None:
    """1-4 consecutive turns of a conversation, ending on a turn that asks or says enough."""
    ends = [i for i, t in enumerate(turns) if t.endswith("?") or len(t.split()) >= 5]
    if not ends:
        return None
    end = rng.choice(ends)
    start = max(0, end + 1 - rng.choice((1, 1, 2, 3, 4)))
    picked = turns[start:end + 1]
    while len(picked) > 1 and words(picked) > MAX_WORDS:
        picked = picked[1:]
    return picked if words(picked) <= MAX_WORDS else None


def chatterbot_prompt(turns: list[str], rng: random.Random) -> list[str] | None:
    """A dialogue cut before one of its answers: turns [0, k] with k even (user turns)."""
    ks = [k for k in range(0, len(turns) - 1, 2)] or [0]
    k = rng.choice(ks)
    picked = turns[:k + 1]
    return picked if words(picked) <= MAX_WORDS else None


def conversation_prompts(pool: str, rng: random.Random, held_out) -> dict[str, list[tuple[str, list[str]]]]:
    """{source: [(category, turns)]} from the conversations of one pool: "train" (buckets 1-7) or
    "heldout" (bucket 0)."""
    want = (lambda b: b == 0) if pool == "heldout" else (lambda b: b != 0)
    out: dict[str, list[tuple[str, list[str]]]] = {"chitchat": [], "chatterbot": []}
    for key, turns in chitchat_conversations():
        if want(bucket(key)):
            picked = chitchat_prompt(turns, rng)
            if picked and not held_out.matches(picked[-1]):
                out["chitchat"].append(("conversation" if len(picked) == 1 else "multi-turn", picked))
    for key, language, turns in chatterbot_conversations():
        if want(bucket(key)):
            picked = chatterbot_prompt(turns, rng)
            if picked and not held_out.matches(picked[-1]):
                category = "qa" if language == "english" else f"non-english:{language}"
                out["chatterbot"].append((category, picked))
    return out


def row(source: str, number: int, category: str, turns: list[str]) -> dict:
    return {"id": f"{source}-{number:05d}", "category": category, "source": source,
            "messages": messages_from_turns(turns)}


def build_train(n: int, seed: int, held_out) -> list[dict]:
    rng = random.Random(seed)
    seen: set[str] = set()

    def fresh(turns: list[str]) -> bool:
        key = normalize(" | ".join(turns))
        if not key or key in seen:
            return False
        seen.add(key)
        return True

    pools = conversation_prompts("train", rng, held_out)
    picked: list[tuple[str, str, list[str]]] = []
    for source, share in TRAIN_SHARE.items():
        candidates = pools[source]
        rng.shuffle(candidates)
        taken = [(source, c, t) for c, t in candidates if fresh(t)][:int(share * n)]
        picked += taken
    keep = (lambda text: fresh([text]) and not held_out.matches(text))
    picked += [("generated", c, [t]) for c, t in generated_prompts(rng, n - len(picked), keep)]
    rng.shuffle(picked)
    counts: Counter = Counter()
    rows = []
    for source, category, turns in picked[:n]:
        counts[source] += 1
        rows.append(row(source, counts[source], category, turns))
    return rows


def build_heldout(per_source: dict[str, int], seed: int, held_out) -> list[dict]:
    """The evaluation set: written requests plus conversations of the held-out bucket; the
    chatterbot share spread over languages (English at most a third)."""
    rng = random.Random(seed)
    pools = conversation_prompts("heldout", rng, held_out)
    written = [(c, [t]) for c, t in HELDOUT_WRITTEN] + HELDOUT_WRITTEN_FOLLOWUPS
    rows = [row("written", i + 1, c, t) for i, (c, t) in enumerate(written)]
    chit = pools["chitchat"]
    rng.shuffle(chit)
    rows += [row("chitchat", i + 1, c, t) for i, (c, t) in enumerate(chit[:per_source["chitchat"]])]
    by_language: dict[str, list] = {}
    for c, t in pools["chatterbot"]:
        by_language.setdefault(c, []).append(t)
    n_bot = per_source["chatterbot"]
    english = list({normalize(" ".join(t)): t for t in by_language.pop("qa", [])}.values())
    picks = [("qa", t) for t in rng.sample(english, min(len(english), n_bot // 3))]
    languages = [f"non-english:{lang}" for lang in EVAL_LANGUAGES if f"non-english:{lang}" in by_language]
    rng.shuffle(languages)
    picks += [(lang, rng.choice(by_language[lang])) for lang in languages[:n_bot - len(picks)]]
    rows += [row("chatterbot", i + 1, c, t) for i, (c, t) in enumerate(picks)]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", choices=("train", "heldout"))
    parser.add_argument("--out", type=Path, required=True, help="output JSONL file")
    parser.add_argument("--n", type=int, default=4000, help="train: number of prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chitchat", type=int, default=8, help="heldout: chitchat conversations")
    parser.add_argument("--chatterbot", type=int, default=9, help="heldout: chatterbot dialogues")
    parser.add_argument("--exclude", type=Path, action="append", default=[],
                        help="extra held-out prompt file (any load_prompts format); repeatable")
    args = parser.parse_args(argv)
    files = HELD_OUT_FILES + args.exclude
    if args.which == "train":
        files = files + [Path(__file__).resolve().parents[1] / "entmtp" / "prompts" / "heldout_chat.jsonl"]
    held_out = load_held_out([f for f in files if f.is_file()])
    if args.which == "train":
        rows = build_train(args.n, args.seed, held_out)
    else:
        rows = build_heldout({"chitchat": args.chitchat, "chatterbot": args.chatterbot}, args.seed, held_out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    sources = Counter(r["source"] for r in rows)
    turns = Counter(len(r["messages"]) for r in rows)
    print(f"wrote {len(rows)} prompts to {args.out}: " + ", ".join(f"{s} {k}" for s, k in sorted(sources.items())))
    print("messages per prompt: " + ", ".join(f"{k}: {v}" for k, v in sorted(turns.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
