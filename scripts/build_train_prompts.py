"""Build the TRAINING prompt file for draft-head self-distillation.

Command (from the repository root, in the venv):

    python scripts/build_train_prompts.py --out runs/train_prompts.jsonl --n 3000 --seed 0

Output: JSONL rows ``{"id": ..., "category": ..., "messages": [{"role": "user", "content": ...}]}``
(readable by ``entmtp.data.load_prompts``).  Only prompts are written; the answers come from the
base model itself during self-distillation.

Sources (all offline, all permissive):

* ``generated`` -- written for this project (Apache-2.0, like the rest of the repository):
  instruction templates (explain, list, compare, poems/stories/emails, tips, how-to, code tasks in
  several languages, arithmetic and word problems with random numbers, summaries of generated
  passages, translation of short sentences, chit-chat openers, ...) filled with topics below.
* ``chatterbot`` -- the PyPI package ``chatterbot-corpus`` (BSD-3-Clause), if installed: the
  questions (first lines of the Q/A pairs) of its English YAML files.
* ``chitchat`` -- the PyPI package ``chitchat-dataset`` (MIT), if installed: the first message of
  each conversation in ``chitchat_dataset/dataset.json`` when it is a question or has >= 5 words.

  Install both with ``pip install chatterbot-corpus chitchat-dataset`` (no heavy dependencies;
  the chatterbot YAML files are read with PyYAML, which ``transformers`` already requires).
  The package files are read directly, their modules are never imported.

Mixing: the external sources each fill at most ``SOURCE_SHARE`` of ``--n``; generated prompts fill
the rest.  Everything is deduplicated (normalized text), shuffled with ``--seed``, and any prompt
that equals or closely matches (same normalized text, or a shared 8-word shingle) a prompt of the
held-out sets ``entmtp/prompts/bench.jsonl`` and ``calib_example.jsonl`` (plus ``--exclude`` files)
is dropped, so evaluation prompts are never trained on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from entmtp.data import load_prompts  # noqa: E402

HELD_OUT_FILES = [ROOT / "entmtp" / "prompts" / "bench.jsonl",
                  ROOT / "entmtp" / "prompts" / "calib_example.jsonl"]
SOURCE_SHARE = {"chatterbot": 0.15, "chitchat": 0.15}  # max share of --n per external source
SHINGLE = 8

# ============================================================================ held-out filter


def normalize(text: str) -> str:
    """Lowercase, punctuation to spaces, whitespace collapsed."""
    return " ".join(re.sub(r"[^\w]+", " ", text.lower()).split())


def shingles(text: str, k: int = SHINGLE) -> set[tuple[str, ...]]:
    words = normalize(text).split()
    return {tuple(words[i:i + k]) for i in range(len(words) - k + 1)}


class HeldOutFilter:
    """``matches(text)`` is True when text equals or closely matches a held-out prompt."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.exact: set[str] = set()
        self.shingles: set[tuple[str, ...]] = set()
        for text in texts:
            self.exact.add(normalize(text))
            self.shingles |= shingles(text)

    def matches(self, text: str) -> bool:
        return normalize(text) in self.exact or not self.shingles.isdisjoint(shingles(text))


def load_held_out(paths: Iterable[Path]) -> HeldOutFilter:
    texts = []
    for path in paths:
        texts += [p.user_text for p in load_prompts(path).prompts]
    return HeldOutFilter(texts)


def drop_held_out(candidates: list[tuple[str, str]], held_out: HeldOutFilter) -> list[tuple[str, str]]:
    """Keep the (category, text) candidates that do not match a held-out prompt."""
    return [c for c in candidates if not held_out.matches(c[1])]


# ============================================================================ external sources


def package_dir(name: str) -> Path | None:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


CHATTERBOT_CATEGORY = {"coding": "code", "greetings": "conversation", "conversations": "conversation",
                       "emotion": "conversation", "gossip": "conversation", "humor": "conversation",
                       "botprofile": "conversation"}


def chatterbot_prompts() -> list[tuple[str, str]]:
    directory = package_dir("chatterbot_corpus")
    if directory is None:
        print("note: chatterbot-corpus is not installed; skipping it (pip install chatterbot-corpus)")
        return []
    try:
        import yaml
    except ImportError:
        print("note: PyYAML is not installed; skipping chatterbot-corpus")
        return []
    out = []
    for path in sorted((directory / "data" / "english").glob("*.yml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        category = CHATTERBOT_CATEGORY.get(path.stem, "qa")
        for pair in doc.get("conversations") or []:
            if isinstance(pair, list) and pair and isinstance(pair[0], str) and pair[0].strip():
                out.append((category, pair[0].strip()))
    return out


def chitchat_data() -> dict:
    """chitchat-dataset's conversations by id ({} with a note when it is not installed)."""
    directory = package_dir("chitchat_dataset")
    if directory is None or not (directory / "dataset.json").is_file():
        print("note: chitchat-dataset is not installed; skipping it (pip install chitchat-dataset)")
        return {}
    return json.loads((directory / "dataset.json").read_text(encoding="utf-8"))


def chitchat_prompts() -> list[tuple[str, str]]:
    data = chitchat_data()
    out = []
    for conversation in data.values():
        turns = conversation.get("messages") or []
        if not turns or not turns[0] or not isinstance(turns[0][0].get("text"), str):
            continue
        text = " ".join(turns[0][0]["text"].split())
        words = len(text.split())
        if (text.endswith("?") or words >= 5) and words <= 80:
            out.append(("conversation", text))
    return out


# ============================================================================ generated prompts

def lines(block: str) -> list[str]:
    return [line.strip() for line in block.strip().splitlines() if line.strip()]


TOPICS = lines("""
photosynthesis
the water cycle
volcanoes
earthquakes
black holes
the solar system
the Moon's phases
gravity
magnets
electricity
static electricity
rainbows
clouds
thunderstorms
hurricanes
tides
glaciers
coral reefs
rainforests
deserts
the Arctic tundra
wetlands
rivers and deltas
the ozone layer
climate change
renewable energy
solar panels
wind turbines
nuclear power
recycling
composting
plastic pollution
bees and pollination
migrating birds
whales
dolphins
penguins
elephants
octopuses
ants
butterflies and metamorphosis
wolves
domestic cats
dogs as pets
horses
sharks
frogs
dinosaurs
fossils
evolution
DNA
the human heart
the immune system
sleep
dreams
nutrition
vitamins
drinking enough water
exercise
stretching
meditation
stress
friendship
kindness
habits
procrastination
time management
public speaking
learning a new language
reading for pleasure
libraries
museums
the printing press
the invention of the wheel
ancient Egypt
the pyramids
ancient Greece
the Olympic Games
the Roman Empire
the Great Wall of China
the Silk Road
the Vikings
medieval castles
the Renaissance
the Industrial Revolution
steam engines
railways
the history of flight
the Wright brothers
the first Moon landing
space stations
Mars rovers
satellites
telescopes
microscopes
vaccines
antibiotics
the discovery of penicillin
hospitals
first aid
the internet
email
smartphones
social media
video games
computer programming
artificial intelligence
robots
self-driving cars
electric cars
bicycles
public transportation
airports
bridges
skyscrapers
tunnels
lighthouses
maps
compasses
GPS
clocks
calendars
money
banks
saving money
budgeting
credit cards
inflation
supply and demand
small businesses
farmers markets
coffee
tea
chocolate
bread baking
pizza
cheese
rice
spices
vegetarian cooking
breakfast
school lunches
gardening
houseplants
tomatoes
apple trees
sunflowers
forests
mushrooms
camping
hiking
mountain climbing
swimming
soccer
basketball
tennis
chess
board games
jigsaw puzzles
crossword puzzles
music
the piano
the guitar
jazz
classical music
drums
singing in a choir
painting
drawing
photography
pottery
knitting
origami
dance
theater
movies
cartoons
comic books
poetry
fairy tales
myths and legends
libraries in the digital age
writing letters
handwriting
the alphabet
numbers and counting
fractions
geometry
prime numbers
probability
statistics
the number zero
volunteering
recycling at home
neighborhoods
city parks
playgrounds
zoos
aquariums
national parks
islands
mountains
oceans
lakes
waterfalls
caves
the night sky
constellations
comets
meteor showers
the Sun
eclipses
seasons
snow
autumn leaves
spring flowers
summer holidays
birthdays
weddings
family traditions
grandparents
siblings
babies learning to talk
teenagers
retirement
moving to a new home
roommates
pets and responsibility
teamwork
leadership
job interviews
remote work
open-plan offices
commuting
four-day work weeks
customer service
online shopping
advertising
newspapers
podcasts
radio
television
cinema history
architecture
bridges in history
castles
cathedrals
ancient libraries
paper
ink
pencils
glass
steel
plastics
cotton
wool
silk
weaving
fashion
uniforms
shoes
hats
umbrellas
weather forecasts
earth's layers
rocks and minerals
diamonds
gold
salt
sugar
honey
bees
soil
worms
bacteria
viruses
fungi
the human brain
memory
emotions
laughter
curiosity
creativity
boredom
patience
honesty
good manners
table manners
tipping
festivals
fireworks
lanterns
kites
hot air balloons
sailing
canals
trains
trucks
airplanes
helicopters
submarines
rockets
space suits
astronauts
time zones
the International Date Line
languages of the world
sign language
Braille
translation
dictionaries
encyclopedias
spelling bees
homework
exams
summer camps
field trips
science fairs
""")

EXPLAIN_TEMPLATES = lines("""
Explain {topic} in simple terms.
Tell me about {topic}. Keep the answer short.
Give me three interesting facts about {topic}.
How would you describe {topic} to a ten-year-old?
List five key things everyone should know about {topic}.
Why should people care about {topic}?
Write one paragraph introducing {topic}.
What are some common misconceptions about {topic}?
Define {topic} in one or two sentences.
Summarize what you know about {topic} in three bullet points.
Briefly, what is the history of {topic}?
If you taught a class on {topic}, what would the first lesson cover?
Give me a fun fact about {topic}.
What questions do people often ask about {topic}?
Explain {topic} using an everyday analogy.
What would surprise a beginner about {topic}?
""")

WRITING_TEMPLATES = lines("""
Write a short poem about {topic}.
Write a haiku about {topic}.
Tell me a very short story that involves {topic}.
Write a limerick about {topic}.
Write a short quiz with three questions about {topic}.
Write a tweet-length description of {topic}.
Write a short encyclopedia-style entry on {topic}.
Write a cheerful slogan for a poster about {topic}.
""")

COMPARE_PAIRS = [tuple(line.split(" | ")) for line in lines("""
cats | dogs
tea | coffee
trains | airplanes
summer | winter
reading books | watching movies
cities | the countryside
email | phone calls
walking | cycling
the Sun | the Moon
rivers | lakes
frogs | toads
crocodiles | alligators
weather | climate
viruses | bacteria
a lake | a sea
butter | margarine
paper books | e-readers
renting a home | buying a home
working from home | working in an office
Python | JavaScript
a laptop | a desktop computer
solar power | wind power
baking | frying
soccer | basketball
chess | checkers
the piano | the guitar
painting | photography
a poem | a short story
a simile | a metaphor
saving | investing
a debit card | a credit card
a hurricane | a tornado
a comet | an asteroid
a star | a planet
weight | mass
speed | velocity
a virus | a computer virus
breakfast | brunch
a museum | a library
a hobby | a job
""")]

COMPARE_TEMPLATES = lines("""
Compare {a} and {b}.
What is the difference between {a} and {b}?
What do {a} and {b} have in common?
Make a short table comparing {a} and {b}.
""")

TASKS = lines("""
bake a simple loaf of bread
start running regularly
keep a houseplant alive
learn to play the guitar
make a budget for the month
write a good cover letter
prepare for a job interview
fall asleep faster
study for an exam
organize a small closet
plan a birthday party
make a paper airplane
clean a laptop keyboard
save money on groceries
learn basic Spanish
take better photos with a phone
start a vegetable garden on a balcony
make friends at a new school
brew a good cup of tea
cook rice on the stove
change a flat bicycle tire
reduce food waste at home
train a puppy to sit
keep a journal
wake up earlier
memorize a short speech
stay focused while working from home
pack for a weekend trip
make a simple tomato sauce
teach a child to ride a bike
write a thank-you letter
stop procrastinating
prepare for a long hike
make homemade pizza dough
learn to type faster
improve my handwriting
be a better listener
plan a road trip
decorate a small room on a budget
care for a pet goldfish
start meditating
make a good first impression
stay safe during a thunderstorm
recycle correctly
choose a good book to read
set goals for the new year
make pancakes
paint a wall
sew on a button
build a simple birdhouse
""")

HOWTO_TEMPLATES = lines("""
How do I {task}?
Give me step-by-step instructions to {task}.
What are some tips to {task}?
What mistakes should I avoid when I try to {task}?
I want to {task}. Where should I start?
""")

EMAILS = [tuple(line.split(" | ")) for line in lines("""
my landlord | asking them to fix a leaking kitchen tap
my manager | asking for Friday afternoon off
a coworker | thanking them for their help on a project
my child's teacher | explaining that my son was sick yesterday
a hotel | asking whether they have a room for two nights in May
a friend | inviting them to a barbecue on Saturday
my neighbors | letting them know about a party we are having
a customer | apologizing for a delayed order
a bookstore | asking if they have a certain cookbook in stock
my team | announcing that the meeting moved to Thursday
a gym | cancelling my membership
my aunt | thanking her for a birthday present
a restaurant | booking a table for six people
a plumber | asking for a quote to replace a water heater
my professor | asking for an extension on an essay
a new colleague | welcoming them to the team
a local library | suggesting they add a chess club
the city council | complaining about a broken street light
a dentist | rescheduling an appointment
an old school friend | saying I will be visiting their town
""")]

EMAIL_TEMPLATES = lines("""
Write a short email to {who} {why}.
Draft a polite message to {who} {why}.
Help me write a brief text message to {who} {why}.
""")

LANGUAGES = ["Python", "JavaScript", "TypeScript", "Java", "C", "C++", "C#", "Go", "Rust", "Ruby",
             "PHP", "Kotlin"]

CODE_TASKS = lines("""
reverse a list
check whether a number is prime
compute the factorial of a number
find the second largest number in a list
count the words in a sentence
remove duplicates from a list
check if two words are anagrams
convert a string to title case
compute the nth Fibonacci number
sort a list of names alphabetically
find the most common character in a string
sum all even numbers in a list
check whether a year is a leap year
convert miles to kilometers
merge two sorted lists
flatten a nested list
count how often each word appears in a text
validate that a password has at least eight characters and a digit
compute the average of a list of numbers
find the greatest common divisor of two numbers
generate a random password
print a multiplication table
check if a string contains only digits
capitalize the first letter of every word
swap two variables
find the index of an item in a list
split a sentence into words
join a list of strings with commas
compute the area of a circle
convert a number to binary
read a file and print its first five lines
write a list of numbers to a file
compute the sum of the digits of a number
reverse the words in a sentence
check whether a list is sorted
""")

CODE_TEMPLATES = lines("""
Write a {lang} function to {task}.
How do I {task} in {lang}?
Show me {lang} code to {task}, with a short explanation.
Write a short {lang} program that can {task}.
""")

CODE_CONCEPTS = lines("""
a variable
a function
recursion
a loop
an array
a dictionary or hash map
a class
inheritance
an exception
a pointer
a unit test
a compiler
an API
version control
a database index
a race condition
big O notation
a stack
a queue
a linked list
""")

CONCEPT_TEMPLATES = lines("""
Explain what {concept} is in programming.
Give a simple {lang} example of {concept}.
""")

TRANSLATION_SENTENCES = lines("""
The shop closes at six in the evening.
I have two brothers and one sister.
Could you help me carry this box?
My favorite color is green.
We had pasta for dinner last night.
The museum is next to the old church.
It is raining, so take an umbrella.
I am looking for a pharmacy.
She reads the newspaper every morning.
The children are sleeping upstairs.
This soup is too hot.
Where can I buy a ticket?
My phone battery is almost empty.
He works in a hospital.
The park is beautiful in the spring.
I don't understand the question.
Can I pay by card?
We are waiting for the bus.
The water in the lake is very cold.
Happy birthday, I hope you have a wonderful day.
I need to wake up early tomorrow.
The cat is hiding under the bed.
Is there a bank near here?
I would like to order a salad.
Our train leaves in ten minutes.
My grandmother makes the best apple cake.
Please speak more slowly.
The door is open.
What time is it?
I am very happy to meet you.
The concert starts at eight.
Let's go for a walk after lunch.
This street is very quiet at night.
I lost my keys again.
The teacher gave us a lot of homework.
How long does it take to get to the airport?
I like listening to music while I cook.
The flowers in the garden are red and yellow.
We will visit our cousins in August.
Excuse me, is this seat free?
""")

TARGET_LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]

TRANSLATION_TEMPLATES = lines("""
Translate into {lang}: {s}
How do you say "{s}" in {lang}?
Translate the following sentence from English to {lang}: {s}
What is the {lang} translation of "{s}"?
""")

CHAT_OPENERS = lines("""
Hi! How is your day going?
Good morning! What's a good way to start the day?
What's your favorite season, and why?
Hello! Can you tell me a joke?
I'm a bit bored. Can we chat for a while?
What would you do with a free afternoon?
Do you have a favorite book you could recommend?
What's a good movie for a cozy night in?
If you could visit any place in the world, where would you go?
What is something small that can make a day better?
I finally finished a big project today!
What's a good question to break the ice at a party?
Can you recommend a song for a long drive?
I can't decide what to cook tonight. Any ideas?
Tell me about a skill that is fun to learn as an adult.
What is the best way to relax after a long week?
I just adopted a kitten. What should I name her?
Do you think it's better to be an early bird or a night owl?
What are some fun things to do on a snowy day?
How can I cheer up a friend who is having a hard week?
What should I do this weekend if the weather is nice?
Hey, what's a nice compliment I could give a coworker?
What is a good habit to start this month?
Can you give me a riddle to solve?
What is something interesting you could teach me in one minute?
""")

MOODS = ["tired", "stressed", "excited", "nervous", "a little lonely", "unmotivated", "homesick",
         "overwhelmed", "proud of myself", "bored"]
HOBBIES = ["hiking", "painting", "cooking", "chess", "gardening", "photography", "knitting",
           "video games", "birdwatching", "baking", "running", "jigsaw puzzles"]

CHAT_TEMPLATES = lines("""
I'm feeling {mood} today. Any advice?
Do you think {hobby} is a good hobby for a beginner?
What do you find interesting about {topic}?
I've been getting into {hobby} lately. Any tips?
""")

INVENTIONS = ["the telephone", "the light bulb", "the printing press", "the airplane", "the radio",
              "the bicycle", "paper", "the compass", "the telescope", "the steam engine",
              "the World Wide Web", "the thermometer", "the microwave oven", "the camera",
              "the pencil", "the refrigerator"]
PLACES = ["the Amazon rainforest", "Mount Kilimanjaro", "the Sahara Desert", "the Great Barrier Reef",
          "Iceland", "Lake Baikal", "the Nile River", "Machu Picchu", "the Alps", "Madagascar",
          "New Zealand", "the Dead Sea", "Patagonia", "the Gobi Desert", "Greenland"]
DEVICES = ["a microwave oven", "a bicycle gear", "a thermostat", "a smoke detector", "a solar panel",
           "a battery", "a touch screen", "a camera lens", "an elevator", "a washing machine",
           "a compass", "a hearing aid", "a vacuum cleaner", "a zipper", "a light switch"]

QA_TEMPLATES = {
    "invention": lines("""
Who invented {x}, and when?
How did {x} change everyday life?
"""),
    "place": lines("""
Where is {x} located?
What is {x} famous for?
"""),
    "device": lines("""
How does {x} work?
Explain in a few sentences how {x} works.
"""),
}

NAMES = ["Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jonas", "Kofi",
         "Lucia", "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor",
         "Wen", "Yara", "Zoe"]
ITEMS = [("apples", 1), ("notebooks", 3), ("pens", 2), ("tickets", 12), ("cupcakes", 3),
         ("stickers", 1), ("books", 9), ("plants", 7), ("candles", 4), ("T-shirts", 15)]
TOWNS = ["Riverton", "Oakfield", "Millbrook", "Harbor Point", "Cedar Falls", "Lakeside", "Pinewood",
         "Stonebridge", "Fairview", "Willow Creek"]


def gen_explain(rng: random.Random) -> str:
    return rng.choice(EXPLAIN_TEMPLATES).format(topic=rng.choice(TOPICS))


def gen_writing(rng: random.Random) -> str:
    if rng.random() < 0.3:
        who, why = rng.choice(EMAILS)
        return rng.choice(EMAIL_TEMPLATES).format(who=who, why=why)
    return rng.choice(WRITING_TEMPLATES).format(topic=rng.choice(TOPICS))


def gen_compare(rng: random.Random) -> str:
    a, b = rng.choice(COMPARE_PAIRS)
    if rng.random() < 0.5:
        a, b = b, a
    return rng.choice(COMPARE_TEMPLATES).format(a=a, b=b)


def gen_howto(rng: random.Random) -> str:
    return rng.choice(HOWTO_TEMPLATES).format(task=rng.choice(TASKS))


def gen_code(rng: random.Random) -> str:
    lang = rng.choice(LANGUAGES)
    if rng.random() < 0.2:
        return rng.choice(CONCEPT_TEMPLATES).format(concept=rng.choice(CODE_CONCEPTS), lang=lang)
    return rng.choice(CODE_TEMPLATES).format(lang=lang, task=rng.choice(CODE_TASKS))


def gen_math(rng: random.Random) -> str:
    r = rng.randint
    name, other = rng.sample(NAMES, 2)
    kind = rng.randrange(12)
    if kind == 0:
        a, b = r(11, 999), r(11, 999)
        return rng.choice(["What is {a} + {b}?", "Add {a} and {b}.", "Calculate {a} plus {b}."]).format(a=a, b=b)
    if kind == 1:
        a, b = r(100, 999), r(10, 99)
        return rng.choice(["What is {a} - {b}?", "Subtract {b} from {a}."]).format(a=a, b=b)
    if kind == 2:
        a, b = r(3, 99), r(3, 25)
        return rng.choice(["What is {a} times {b}?", "Multiply {a} by {b}.", "Compute {a} x {b}."]).format(a=a, b=b)
    if kind == 3:
        b, q = r(2, 15), r(3, 60)
        return rng.choice(["What is {a} divided by {b}?", "Divide {a} by {b}."]).format(a=b * q, b=b)
    if kind == 4:
        p, x = rng.choice([5, 10, 20, 25, 30, 40, 50, 75]), r(2, 60) * 10
        return f"What is {p}% of {x}?"
    if kind == 5:
        (item, price), count = rng.choice(ITEMS), r(2, 9)
        return (f"{name} buys {count} {item} that cost ${price} each and pays with a "
                f"${price * count + r(1, 20)} bill. How much change does {name} get?")
    if kind == 6:
        speed, hours = r(4, 12) * 10, r(2, 7)
        return f"A car drives at {speed} km per hour for {hours} hours. How far does it travel?"
    if kind == 7:
        friends, each = r(2, 8), r(2, 12)
        return (f"{name} has {friends * each} marbles and shares them equally with {friends - 1} "
                f"friends, keeping one share too. How many marbles does each person get?")
    if kind == 8:
        weekly, weeks = r(2, 20) * 5, r(3, 12)
        return f"{name} saves ${weekly} every week. How much will {name} have saved after {weeks} weeks?"
    if kind == 9:
        x, a = r(1, 20), r(2, 9)
        b = r(1, 30)
        return f"Solve for x: {a}x + {b} = {a * x + b}."
    if kind == 10:
        w, h = r(2, 20), r(2, 20)
        return rng.choice([f"What is the perimeter of a rectangle that is {w} cm by {h} cm?",
                           f"A room is {w} meters long and {h} meters wide. What is its area?"])
    nums = [r(1, 50) for _ in range(r(3, 6))]
    older = r(2, 10)
    return rng.choice([f"What is the average of {', '.join(map(str, nums))}?",
                       f"{name} is {older} years older than {other}. {other} is {nums[0]}. "
                       f"How old will {name} be in {nums[1] % 10 + 1} years?"])


def generated_passage(rng: random.Random) -> str:
    """A short made-up passage assembled from sentence pieces."""
    name, town = rng.choice(NAMES), rng.choice(TOWNS)
    kind = rng.randrange(3)
    if kind == 0:
        event = rng.choice(["summer fair", "book festival", "food market", "charity run", "music night"])
        sentences = [
            f"{town} held its yearly {event} last {rng.choice(['Saturday', 'Sunday', 'weekend'])}.",
            f"About {rng.randint(2, 40) * 50} people came, {rng.choice(['more than last year', 'despite the rain', 'a new record'])}.",
            rng.choice(["Local bakers sold out of pies before noon.", "A children's choir opened the day.",
                        "Volunteers collected money for the town library.", "A new playground was unveiled."]),
            f"The organizer, {name}, said the best part was {rng.choice(['seeing neighbors meet', 'the live music', 'the weather holding up'])}.",
            rng.choice(["Next year the event will move to the riverside park.",
                        "Organizers hope to add a second day next year.",
                        "Some residents asked for more parking next time."]),
        ]
    elif kind == 1:
        job = rng.choice(["nurse", "carpenter", "baker", "teacher", "bus driver", "chef", "librarian"])
        sentences = [
            f"{name} has worked as a {job} in {town} for {rng.randint(3, 30)} years.",
            rng.choice([f"{name} starts work before sunrise most days.",
                        f"Colleagues describe {name} as calm and funny.",
                        f"{name} first took the job as a summer position."]),
            rng.choice(["The hardest part, they say, is the long winter shifts.",
                        "The job has changed a lot since new machines arrived.",
                        "Every day brings a different problem to solve."]),
            f"In their free time, {name} enjoys {rng.choice(HOBBIES)}.",
            rng.choice([f"{name} plans to train a new apprentice next year.",
                        f"Last month {name} received an award from the town.",
                        f"{name} says they cannot imagine doing anything else."]),
        ]
    else:
        product = rng.choice(["backpack", "desk lamp", "blender", "pair of running shoes", "umbrella"])
        sentences = [
            f"I bought this {product} {rng.randint(2, 11)} months ago.",
            rng.choice(["It feels sturdy and well made.", "It was cheaper than similar ones.",
                        "It arrived quickly and well packed."]),
            rng.choice(["My only complaint is that it is heavier than expected.",
                        "However, the color faded after a few weeks.",
                        "The instructions were confusing, though."]),
            rng.choice(["Overall I would buy it again.", "I would give it four stars out of five.",
                        "It is fine for the price, but not amazing."]),
        ]
    return " ".join(sentences)


SUMMARY_TEMPLATES = lines("""
Summarize this in one sentence: {p}
Give me the main points of the following text. {p}
Write a short summary of this paragraph: {p}
What is this text about? Answer in one sentence. {p}
Shorten this to two sentences: {p}
""")


def gen_summarization(rng: random.Random) -> str:
    template = rng.choice(SUMMARY_TEMPLATES)
    head, _, tail = template.partition("{p}")
    return f"{head.strip()}\n\n{generated_passage(rng)}" + (f"\n\n{tail.strip()}" if tail.strip() else "")


def gen_translation(rng: random.Random) -> str:
    return rng.choice(TRANSLATION_TEMPLATES).format(lang=rng.choice(TARGET_LANGUAGES),
                                                    s=rng.choice(TRANSLATION_SENTENCES))


def gen_conversation(rng: random.Random) -> str:
    if rng.random() < 0.4:
        return rng.choice(CHAT_OPENERS)
    return rng.choice(CHAT_TEMPLATES).format(mood=rng.choice(MOODS), hobby=rng.choice(HOBBIES),
                                             topic=rng.choice(TOPICS))


def gen_qa(rng: random.Random) -> str:
    kind, pool = rng.choice([("invention", INVENTIONS), ("place", PLACES), ("device", DEVICES)])
    return rng.choice(QA_TEMPLATES[kind]).format(x=rng.choice(pool))


# (category, weight, generator)
GENERATORS: list[tuple[str, float, Callable[[random.Random], str]]] = [
    ("explain", 18, gen_explain),
    ("writing", 12, gen_writing),
    ("compare", 5, gen_compare),
    ("howto", 9, gen_howto),
    ("code", 15, gen_code),
    ("math", 12, gen_math),
    ("summarization", 8, gen_summarization),
    ("translation", 8, gen_translation),
    ("conversation", 7, gen_conversation),
    ("qa", 6, gen_qa),
]


def generated_prompts(rng: random.Random, count: int, keep: Callable[[str], bool]) -> list[tuple[str, str]]:
    """Up to ``count`` distinct generated (category, text) pairs for which ``keep(text)`` holds."""
    weights = [w for _, w, _ in GENERATORS]
    out: list[tuple[str, str]] = []
    attempts = 0
    while len(out) < count and attempts < 50 * count + 1000:
        attempts += 1
        category, _, make = rng.choices(GENERATORS, weights)[0]
        text = make(rng)
        if keep(text):
            out.append((category, text))
    return out


# ============================================================================ assembly


def build(n: int, seed: int, held_out: HeldOutFilter) -> tuple[list[dict], Counter]:
    rng = random.Random(seed)
    seen: set[str] = set()

    def keep(text: str) -> bool:
        key = normalize(text)
        if not key or key in seen or held_out.matches(text):
            return False
        seen.add(key)
        return True

    picked: list[tuple[str, str, str]] = []  # (source, category, text)
    for source, load in (("chatterbot", chatterbot_prompts), ("chitchat", chitchat_prompts)):
        candidates = drop_held_out(load(), held_out)
        rng.shuffle(candidates)
        cap = int(SOURCE_SHARE[source] * n)
        taken = 0
        for category, text in candidates:
            if taken >= cap:
                break
            if keep(text):
                picked.append((source, category, text))
                taken += 1
    for category, text in generated_prompts(rng, n - len(picked), keep):
        picked.append(("generated", category, text))
    rng.shuffle(picked)

    rows, counts = [], Counter()
    for source, category, text in picked[:n]:
        counts[source] += 1
        rows.append({"id": f"{source}-{counts[source]:05d}", "category": category,
                     "messages": [{"role": "user", "content": text}]})
    return rows, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output JSONL file")
    parser.add_argument("--n", type=int, default=3000, help="number of prompts (default 3000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude", type=Path, action="append", default=[],
                        help="extra held-out prompt file (any load_prompts format); repeatable")
    parser.add_argument("--only-ids", type=Path, default=None,
                        help="keep only the rows whose id is listed in this file (one per line): the subset a "
                             "time-budgeted self-distillation answered, e.g. assets/heads/train_prompt_ids.txt")
    parser.add_argument("--id-prefix", default="",
                        help="prepend this to every id (files built with other seeds reuse ids: e.g. 's2-' keeps "
                             "them distinct when concatenated with a seed-0 file)")
    parser.add_argument("--dedupe-against", type=Path, action="append", default=[],
                        help="earlier TRAINING prompt file: drop built prompts whose text is exactly one of its "
                             "prompts (after normalisation); unlike --exclude, near matches are kept. Repeatable")
    parser.add_argument("--max-per-category", type=int, default=0,
                        help="keep at most this many prompts of each category, in file order (0 = no cap)")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("--n must be at least 1")

    held_out = load_held_out(HELD_OUT_FILES + args.exclude)
    rows, counts = build(args.n, args.seed, held_out)
    if args.only_ids is not None:
        try:
            wanted = {line.strip() for line in args.only_ids.read_text(encoding="utf-8").splitlines() if line.strip()}
        except OSError as e:
            parser.error(f"--only-ids: cannot read {args.only_ids}: {e.strerror}")
        missing = wanted - {r["id"] for r in rows}
        if missing:
            parser.error(f"--only-ids: {len(missing)} ids are not among the {len(rows)} built prompts "
                         f"(e.g. {sorted(missing)[0]}); use the same --n, --seed and --exclude as the listed run")
        rows = [r for r in rows if r["id"] in wanted]
    if args.dedupe_against:
        seen = set()
        for path in args.dedupe_against:
            seen |= {normalize(p.user_text) for p in load_prompts(path).prompts}
        rows = [r for r in rows if normalize(r["messages"][-1]["content"]) not in seen]
    if args.max_per_category > 0:
        taken: Counter = Counter()
        capped = []
        for r in rows:
            if taken[r["category"]] < args.max_per_category:
                taken[r["category"]] += 1
                capped.append(r)
        rows = capped
    counts = Counter(r["id"].rsplit("-", 1)[0] for r in rows)
    for r in rows:
        r["id"] = args.id_prefix + r["id"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    per_source = ", ".join(f"{s} {counts[s]}" for s in ("generated", "chatterbot", "chitchat"))
    per_category = ", ".join(f"{c} {k}" for c, k in sorted(Counter(r["category"] for r in rows).items()))
    print(f"wrote {len(rows)} prompts to {args.out} ({per_source})")
    print(f"categories: {per_category}")
    if len(rows) < args.n and args.only_ids is None and not args.dedupe_against and not args.max_per_category:
        print(f"note: only {len(rows)} distinct prompts were available (asked for {args.n})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
