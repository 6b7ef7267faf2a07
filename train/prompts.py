"""Prompt synthesis for self-distillation: many topics x many task templates, plus predictable prompts.

`training_prompts(seed)` is a fixed, seeded list of chat prompts (message lists); the same seed always gives
the same list in the same order, so `distill.py` can resume by prompt index. About 15% of the list is
highly predictable text (counting, alphabets, tables, boilerplate): speculative decoding's best case, which
the drafter must learn to continue. `heldout_prompts()` draws only from topics and templates that the
training list never uses (HELDOUT_*); it is written to train/heldout.json and is the only honest
acceptance figure. No prompt equals a benchmark prompt of ../shared/workloads (checked by `check_disjoint`).

    python -m train.prompts --show 20        # print the first 20 training prompts
    python -m train.prompts --write-heldout  # (re)write train/heldout.json
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELDOUT_FILE = HERE / "heldout.json"
WORKLOADS = Path("/work/shared/workloads")
PREDICTABLE_SHARE = 0.2  # drawn; repeats are skipped, so ~15% of the first few thousand prompts

# ----------------------------------------------------------------------------------------------- topics
TOPICS = {
    "science": ["photosynthesis", "black holes", "the water cycle", "plate tectonics", "DNA replication",
                "the immune system", "climate change", "volcanoes", "the solar system", "gravity",
                "electricity", "magnetism", "the periodic table", "evolution", "vaccines", "antibiotics",
                "the human heart", "sleep", "earthquakes", "ocean currents", "rainbows", "sound waves",
                "nuclear fusion", "bacteria", "the carbon cycle", "glaciers", "the moon's phases", "lightning",
                "coral reefs", "the nervous system", "quantum computing", "superconductors", "enzymes"],
    "technology": ["the internet", "smartphones", "artificial intelligence", "blockchain", "cloud computing",
                   "3D printing", "electric cars", "solar panels", "wind turbines", "GPS", "Wi-Fi",
                   "computer viruses", "open-source software", "databases", "video compression",
                   "search engines", "password managers", "robots", "drones", "virtual reality",
                   "the history of the computer", "operating systems", "email", "batteries", "semiconductors"],
    "history": ["the Roman Empire", "ancient Egypt", "the Renaissance", "the Industrial Revolution",
                "the printing press", "the Silk Road", "the French Revolution", "the Vikings",
                "the Cold War", "the moon landing", "ancient Greece", "the Ottoman Empire", "the Maya",
                "the invention of writing", "the Great Wall of China", "the age of exploration", "the Aztecs",
                "the history of money", "medieval castles", "the Bronze Age"],
    "daily life": ["cooking pasta", "saving money", "learning a language", "getting better sleep",
                   "making coffee", "gardening", "moving to a new city", "planning a birthday party",
                   "cleaning a kitchen", "time management", "public speaking", "job interviews",
                   "running a marathon", "keeping houseplants alive", "budgeting for groceries", "meal prep",
                   "decluttering a room", "adopting a dog", "caring for a cat", "buying a used car",
                   "writing a resume", "staying focused while studying", "making friends as an adult",
                   "packing for a trip", "baking bread", "riding a bicycle in a city"],
    "nature": ["elephants", "octopuses", "honeybees", "rainforests", "deserts", "wolves", "whales",
               "migratory birds", "mushrooms", "sharks", "penguins", "butterflies", "oak trees", "ants",
               "the Amazon river", "mountains", "owls", "dolphins", "tigers", "cacti"],
    "culture": ["jazz music", "the Olympic Games", "chess", "poetry", "photography", "classical music",
                "street food", "tea ceremonies", "board games", "comic books", "film noir", "origami",
                "hip hop", "ballet", "football", "basketball", "museums", "libraries", "architecture",
                "fashion", "video games", "podcasts", "theatre", "impressionist painting"],
    "economics": ["inflation", "supply and demand", "interest rates", "the stock market", "taxes",
                  "small businesses", "international trade", "cryptocurrencies", "unemployment",
                  "credit scores", "startups", "remote work", "marketing", "insurance", "retirement savings"],
    "places": ["Japan", "Brazil", "Canada", "Kenya", "Norway", "India", "Mexico", "Australia", "Italy",
               "Egypt", "Iceland", "Vietnam", "Peru", "Morocco", "New Zealand", "Germany", "Argentina",
               "Thailand", "Scotland", "South Korea"],
    "health": ["drinking enough water", "stretching", "healthy breakfasts", "stress", "posture",
               "screen time", "meditation", "vitamins", "walking every day", "strength training",
               "first aid basics", "handwashing", "sun protection", "mindful eating"],
}

# ---------------------------------------------------------------------------------------- task templates
GENERAL_TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}? Give a short explanation.",
    "Explain {t} to a ten-year-old.",
    "Give me five interesting facts about {t}.",
    "List the key things a beginner should know about {t}.",
    "Write a short story about {t}.",
    "Write a short poem about {t}.",
    "Write a haiku about {t}.",
    "Write a blog post introduction about {t}.",
    "Write an email to a friend telling them about {t}.",
    "Write a formal email to my manager proposing a workshop on {t}.",
    "What are the pros and cons of {t}?",
    "Summarize the history of {t} in a few sentences.",
    "Why is {t} important?",
    "Write a tweet about {t}.",
    "Create a quiz with three questions about {t}, with answers.",
    "Give me an outline for an essay about {t}.",
    "Describe {t} in exactly three sentences.",
    "What questions would an expert ask about {t}?",
    "Write a product description inspired by {t}.",
    "Write a dialogue between two friends discussing {t}.",
    "Give me a step-by-step guide to learning about {t}.",
    "What are three myths and three facts about {t}?",
    "Write a short speech about {t}.",
    "Tell me a fun fact about {t}.",
    "How would you describe {t} to someone from the year 1800?",
    "Write a news headline and a short paragraph about {t}.",
    "Make a table with three columns about {t}: aspect, description, example.",
]
COMPARE_TEMPLATES = [
    "Compare {a} and {b}.",
    "What are the differences between {a} and {b}?",
    "Which is more interesting, {a} or {b}? Explain why.",
    "Write a short paragraph connecting {a} and {b}.",
]
HOWTO = ["cook rice", "change a flat tire", "write a cover letter", "start a vegetable garden", "tie a tie",
         "make a budget", "learn to swim", "brew tea", "organize a closet", "train for a 5k", "paint a room",
         "make pancakes", "study for an exam", "set up a home network", "write a haiku", "plan a road trip",
         "take better photos", "start journaling", "negotiate a salary", "make a paper airplane",
         "clean a laptop keyboard", "fold a fitted sheet", "memorize a speech", "wash a wool sweater",
         "write a thank-you note", "back up a phone", "make a smoothie", "start running", "sharpen a knife"]
HOWTO_TEMPLATES = ["How do I {h}?", "Give me step-by-step instructions to {h}.", "What is the easiest way to {h}?",
                   "I want to {h}. Where should I start?", "List the steps to {h}."]

LANGUAGES = ["Python", "JavaScript", "C", "Rust", "Go", "Java", "C++", "TypeScript", "Bash", "Ruby"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "computes the factorial of n",
              "returns the n-th Fibonacci number", "sorts a list of numbers with bubble sort",
              "counts the words in a sentence", "finds the largest element in an array",
              "checks whether a string is a palindrome", "computes the average of a list",
              "converts Celsius to Fahrenheit", "removes duplicates from a list", "merges two sorted lists",
              "implements binary search", "reads a file and prints its lines", "counts vowels in a string",
              "computes the greatest common divisor of two numbers", "prints a multiplication table",
              "validates an email address", "implements a stack", "flattens a nested list",
              "capitalizes every word in a sentence", "sums the digits of a number"]
CODE_TEMPLATES = ["Write a {lang} function that {task}.", "Show me {lang} code that {task}.",
                  "How do I write a program in {lang} that {task}?",
                  "Write a {lang} function that {task}, with comments."]
CODE_EXPLAIN = ["What does this Python code do?\n\n```python\nfor i in range(10):\n    print(i * i)\n```",
                "Explain this JavaScript:\n\n```js\nconst xs = [1, 2, 3].map(x => x * 2);\n```",
                "Find the bug:\n\n```python\ndef add(a, b):\n    return a - b\n```",
                "What is the output?\n\n```python\nprint(len('hello world'))\n```",
                "Explain this SQL query:\n\n```sql\nSELECT name, COUNT(*) FROM orders GROUP BY name;\n```",
                ("Rewrite this loop as a list comprehension:\n\n```python\nout = []\nfor x in xs:\n"
                 "    if x > 0:\n        out.append(x)\n```"),
                "What is the difference between a list and a tuple in Python?",
                "What is a pointer in C?", "Explain recursion with an example.",
                "What does `git rebase` do?", "What is the difference between TCP and UDP?",
                "Explain what an API is.", "What is Big O notation?", "What is a hash table?"]

PARAGRAPHS = [
    ("The town library reopened last week after a year of renovation. The new building has a children's "
    "wing, a cafe, and a room with 3D printers that anyone can book. Attendance on the first day was "
    "three times higher than before the renovation, and the librarians plan to add evening classes."),
    ("Honeybees communicate the location of food through a movement called the waggle dance. The angle of "
    "the dance shows the direction relative to the sun, and its duration shows the distance. Other bees "
    "follow the dancer and then fly out to find the flowers."),
    ("Our quarterly sales grew by twelve percent, mostly from online orders. Store sales fell slightly. "
    "Shipping costs rose because of fuel prices, so profit grew less than revenue. Next quarter we will "
    "test a new delivery partner and a loyalty program."),
    ("Marie Curie was the first person to win Nobel Prizes in two different sciences, physics and chemistry. "
    "She discovered the elements polonium and radium with her husband Pierre, and her work laid the "
    "foundation for modern radiation therapy."),
    ("The meeting is moved from Tuesday to Thursday at 3 pm because the conference room is being repainted. "
    "Please bring your project updates and the draft budget. Lunch will not be provided this time."),
    ("Composting turns kitchen scraps and garden waste into rich soil. A good compost pile needs a balance "
    "of green material like vegetable peels and brown material like dry leaves, plus air and moisture. "
    "In a few months the pile becomes dark, crumbly compost."),
    ("The hiking trail climbs 600 meters over five kilometers and takes about three hours. Bring water, a "
    "jacket and good shoes. The view from the top covers the whole valley, but the path can be muddy "
    "after rain, so check the weather first."),
    ("Remote work has changed how companies hire. Many teams now recruit across time zones, which widens "
    "the talent pool but makes meetings harder to schedule. Some companies answer this with written "
    "updates instead of daily calls."),
    ("The first bicycles had no pedals: riders pushed the ground with their feet. Pedals were added in the "
    "1860s, and the chain drive with two equal wheels appeared in the 1880s, making bicycles safer and "
    "far more popular."),
    ("Our app update fixes the login crash on older phones, adds a dark mode, and makes photo uploads "
    "twice as fast. We also removed the old sharing menu, which few people used."),
]
PARAGRAPH_TASKS = ["Summarize this paragraph in one sentence:\n\n{p}", "Give three bullet points from this text:\n\n{p}",
                   "Rewrite this text in a more formal tone:\n\n{p}", "Suggest a title for this text:\n\n{p}",
                   "Write two questions a reader might ask about this text:\n\n{p}",
                   "Rewrite this for a child:\n\n{p}"]

MATH_TEMPLATES = [
    "Tom has {a} apples and buys {b} more. How many apples does he have now?",
    "A train travels {a} kilometers in {b} hours. What is its average speed?",
    "What is {a} times {b}?", "What is {a} plus {b}?", "What is {a} minus {b}?",
    "A shirt costs {a} dollars and is on sale for {b} percent off. What is the sale price?",
    "If a rectangle is {a} cm long and {b} cm wide, what is its area and perimeter?",
    "Sara reads {b} pages a day. How many days does she need for a book of {a} pages?",
    "Solve for x: x + {b} = {a}.", "What is {b} percent of {a}?",
    "A class has {a} students and {b} of them are absent. How many are present?",
    "Is {a} divisible by {b}? Explain.",
]
TRIVIA = ["What is the capital of Australia?", "Who wrote Romeo and Juliet?", "How many planets are in the solar system?",
          "What is the largest ocean on Earth?", "Who painted the Mona Lisa?", "What is the boiling point of water?",
          "What is the chemical symbol for gold?", "How many continents are there?", "What is the tallest mountain?",
          "Who invented the telephone?", "What language is spoken in Brazil?", "What is the speed of light?",
          "How many bones are in the human body?", "What is the smallest prime number?",
          "Which planet is known as the Red Planet?", "What is the longest river in the world?",
          "What year did World War II end?", "What is the hardest natural substance?",
          "Who was the first person to walk on the moon?", "What gas do plants absorb?",
          "What is the currency of Japan?", "How many legs does a spider have?", "What is H2O?",
          "Who discovered penicillin?", "What is the largest mammal?", "What is the freezing point of water in Fahrenheit?"]
CHITCHAT = ["Hi!", "Hello, how are you?", "Can you help me with something?", "What can you do?",
            "Tell me a joke.", "Tell me a riddle.", "I'm bored. Any ideas?", "Good morning!",
            "Give me a motivational quote.", "What should I cook for dinner tonight?",
            "Recommend three books for a long flight.", "What's a good name for a goldfish?",
            "Thank you for your help!", "Can you give me a compliment?", "Suggest a weekend activity."]
SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant. Keep answers short.",
           "You are a friendly teacher.", "You are an expert programmer."]

# ----------------------------------------------------------------------------------- predictable prompts
WORDS = ["apple", "hello", "yes", "blue", "ok", "cat", "sun", "go", "la", "tick"]
THINGS = ["fruits", "colors", "animals", "countries", "vegetables", "planets", "musical instruments", "sports",
          "programming languages", "car brands", "flowers", "tools", "cities in Europe", "breakfast foods"]


def _predictable(r: random.Random) -> str:
    a = r.choice([1, 1, 1, 2, 5, 10, 20, 50, 100])
    b = a + r.choice([10, 15, 20, 25, 30, 40, 50, 60, 80, 100, 120, 150, 200])
    n = r.choice([3, 4, 5, 6, 7, 8, 9, 11, 12, 13])
    choices = [
        lambda: f"Count from {a} to {b}.",
        lambda: f"Count from {a} to {b}, separated by commas.",
        lambda: f"Count from {a} to {b}, one number per line.",
        lambda: f"Count from {b} down to {a}.",
        lambda: f"Count by {r.choice([2, 3, 5, 10])}s from {a} to {b + 100}.",
        lambda: f"List the numbers from {a} to {b} separated by spaces.",
        lambda: "Write the English alphabet.", lambda: "Write the alphabet backwards.",
        lambda: "Write the alphabet in capital letters, separated by commas.",
        lambda: "List the days of the week.", lambda: "List the twelve months of the year.",
        lambda: f"Write the multiplication table of {n}.",
        lambda: f"Write the multiplication table of {n} from 1 to 20.",
        lambda: f"Repeat the word '{r.choice(WORDS)}' {r.choice([10, 20, 30, 50])} times.",
        lambda: f"Make a numbered list of {r.choice([10, 15, 20, 30])} {r.choice(THINGS)}.",
        lambda: f"Make a markdown table of the numbers 1 to {r.choice([10, 15, 20])} and their squares.",
        lambda: f"Make a markdown table of the numbers 1 to {r.choice([10, 12, 20])} and their cubes.",
        lambda: "Write a basic HTML page template.",
        lambda: f"Write a {r.choice(['Python', 'Java', 'C++', 'TypeScript'])} class with getters and setters "
                f"for {r.choice(['name, age and email', 'title, author and year', 'x, y and z'])}.",
        lambda: f"Write a JSON array of {r.choice([5, 8, 10])} objects with fields id and name.",
        lambda: f"Write the powers of 2 up to 2^{r.choice([10, 12, 16, 20])}.",
        lambda: f"Write the first {r.choice([20, 30, 50])} even numbers.",
        lambda: f"Write the first {r.choice([15, 20, 25])} square numbers.",
        lambda: "Write the numbers from one to twenty in words.",
        lambda: f"Write a Python list of the numbers from 1 to {b}.",
        lambda: f"Print 'Line 1' to 'Line {r.choice([10, 20, 30])}', one per line.",
        lambda: "Write a C program that prints Hello, World!",
        lambda: f"Write a CSV with a header and {r.choice([5, 10, 15])} rows of id, name, score.",
        lambda: "List the letters of the alphabet with a word for each letter.",
    ]
    return r.choice(choices)()


# ------------------------------------------------------------------------------------------ held-out set
# Topics and templates that the training list never uses.
HELDOUT_TOPICS = ["the Hubble telescope", "submarines", "origami cranes", "the human eye", "bamboo",
                  "hot air balloons", "the Sahara", "lighthouses", "the violin", "kangaroos",
                  "the printing of banknotes", "wildfires", "the metric system", "tides", "recycling plastic",
                  "the Eiffel Tower", "the piano", "mosquitoes", "snowflakes", "traffic lights"]
HELDOUT_TEMPLATES = ["What are common misconceptions about {t}?", "Write a limerick about {t}.",
                     "Describe a day in the life of someone who works with {t}.",
                     "Give me a beginner's study plan for {t}.", "Write a children's rhyme about {t}.",
                     "What would the world be like without {t}?", "Write a museum placard about {t}."]
HELDOUT_OTHER = [
    "Write a Kotlin function that returns the second largest number in a list.",
    "Write a PHP function that converts a string to title case.",
    "What does `chmod 755` mean on Linux?",
    "A baker makes 48 muffins and packs them in boxes of 6. How many boxes does she need?",
    "Who composed the Four Seasons?",
    "Write an apology email to a customer whose order arrived late.",
    ("Summarize this paragraph in one sentence:\n\nThe city council voted to turn the old rail line into "
    "a walking and cycling path. Work starts in spring, and the first three kilometers should open by "
    "autumn. Local shops hope the path will bring more visitors."),
    "I have eggs, spinach and cheese. What can I make for breakfast?",
    "Give me tips for writing clear documentation.",
    "Explain the rules of tennis briefly.",
    "What is the difference between weather and climate?",
    "Write a short bedtime story about a brave snail.",
    "How do noise-cancelling headphones work?",
]
HELDOUT_PREDICTABLE = ["List the odd numbers from 1 to 61.", "Write the numbers from 30 to 90, one per line.",
                       "Write the Roman numerals from I to XX.", "List the first 25 multiples of 4.",
                       "Write a markdown table with columns Day and Number for each day of the week."]


def _user(text: str, system: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": text}]


def _chat_prompt(r: random.Random) -> str:
    """One varied chat prompt: a task family weighted by how much variety it holds."""
    kind = r.choices(["general", "compare", "howto", "code", "code_explain", "paragraph", "math", "trivia",
                      "chitchat"], weights=[40, 6, 8, 12, 3, 6, 8, 4, 2])[0]
    if kind == "general":
        return r.choice(GENERAL_TEMPLATES).format(t=r.choice(r.choice(list(TOPICS.values()))))
    if kind == "compare":
        a, b = r.sample(r.choice(list(TOPICS.values())), 2)
        return r.choice(COMPARE_TEMPLATES).format(a=a, b=b)
    if kind == "howto":
        return r.choice(HOWTO_TEMPLATES).format(h=r.choice(HOWTO))
    if kind == "code":
        return r.choice(CODE_TEMPLATES).format(lang=r.choice(LANGUAGES), task=r.choice(CODE_TASKS))
    if kind == "code_explain":
        return r.choice(CODE_EXPLAIN)
    if kind == "paragraph":
        return r.choice(PARAGRAPH_TASKS).format(p=r.choice(PARAGRAPHS))
    if kind == "math":
        a, b = r.randint(12, 500), r.randint(2, 60)
        return r.choice(MATH_TEMPLATES).format(a=a, b=b)
    if kind == "trivia":
        return r.choice(TRIVIA)
    return r.choice(CHITCHAT)


@dataclass(frozen=True)
class Prompt:
    messages: list  # [{"role", "content"}, ...]
    predictable: bool


def training_prompts(seed: int = 0, n: int = 20000) -> list[Prompt]:
    """n distinct chat prompts, PREDICTABLE_SHARE of them predictable, fixed by seed (fewer when the
    combination space runs out first)."""
    r = random.Random(seed)
    seen, out = set(), []
    banned = benchmark_prompts() | {m[-1]["content"] for m in heldout_prompts()}
    misses = 0
    while len(out) < n and misses < 20000:  # 20000 repeats in a row: the space is used up
        predictable = r.random() < PREDICTABLE_SHARE
        text = _predictable(r) if predictable else _chat_prompt(r)
        system = r.choice(SYSTEMS) if r.random() < 0.15 else None
        if (system, text) in seen or text in banned:
            misses += 1
            continue
        misses = 0
        seen.add((system, text))
        out.append(Prompt(_user(text, system), predictable))
    return out


def heldout_prompts() -> list[list[dict]]:
    """About 45 held-out prompts: unseen topics x unseen templates, unseen other tasks, a few predictable
    (the last len(HELDOUT_PREDICTABLE))."""
    r = random.Random(12345)
    chat = [t.format(t=topic) for t, topic in zip(r.choices(HELDOUT_TEMPLATES, k=27),
                                                  r.sample(HELDOUT_TOPICS, 20) + r.sample(HELDOUT_TOPICS, 7))]
    return [_user(t) for t in chat + HELDOUT_OTHER + HELDOUT_PREDICTABLE]


def is_heldout_predictable(messages: list[dict]) -> bool:
    return messages[-1]["content"] in HELDOUT_PREDICTABLE


def benchmark_prompts() -> set[str]:
    """The user messages of the benchmark workloads (never trained on)."""
    out = set()
    for f in sorted(WORKLOADS.glob("*.json")) if WORKLOADS.is_dir() else []:
        out |= {m["content"] for m in json.loads(f.read_text()) if m.get("role") == "user"}
    return out


def check_disjoint(train: list[Prompt], heldout: list[list[dict]]) -> None:
    """Held-out topics and prompts and the benchmark prompts never appear in training (ValueError naming
    the first that does)."""
    texts = {p.messages[-1]["content"] for p in train}
    for bad in [m[-1]["content"] for m in heldout] + sorted(benchmark_prompts()):
        if bad in texts:
            raise ValueError(f"prompt {bad!r} is in the training list")
    leaks = [t for t in texts if any(w in t for w in HELDOUT_TOPICS)]
    if leaks:
        raise ValueError(f"a held-out topic appears in training prompt {leaks[0]!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=0, help="print the first N training prompts")
    ap.add_argument("--write-heldout", action="store_true", help=f"write {HELDOUT_FILE}")
    a = ap.parse_args()
    train = training_prompts(a.seed)
    held = heldout_prompts()
    check_disjoint(train, held)
    print(f"{len(train)} training prompts, {len(held)} held-out; predictable share "
          f"{sum(p.predictable for p in train) / len(train):.1%}")
    for p in train[:a.show]:
        print(json.dumps(p.messages, ensure_ascii=False))
    if a.write_heldout:
        HELDOUT_FILE.write_text(json.dumps(held, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {HELDOUT_FILE}")


if __name__ == "__main__":
    main()
