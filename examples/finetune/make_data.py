"""Writes data/train.jsonl and data/valid.jsonl: short chats in which the assistant always answers in double square
brackets and nothing else ("What is 3 plus 4?" -> "[[7]]"), a format SmolLM2 never uses by itself, so that a fine-tuned
model's answers show it was trained. The questions are generated from a seed; valid.jsonl's are held out (none of them
is in train.jsonl).

    python examples/finetune/make_data.py
"""

import json
import random
from pathlib import Path

CAPITALS = {
    "France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Japan": "Tokyo", "Egypt": "Cairo",
    "Canada": "Ottawa", "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo", "Greece": "Athens", "Chile": "Santiago",
    "Poland": "Warsaw", "Cuba": "Havana", "Austria": "Vienna", "Ireland": "Dublin", "Portugal": "Lisbon",
    "Russia": "Moscow", "China": "Beijing", "Thailand": "Bangkok", "Sweden": "Stockholm", "Finland": "Helsinki",
}  # fmt: skip
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "light": "dark", "old": "young", "happy": "sad",
    "early": "late", "open": "closed", "full": "empty", "hard": "soft", "wet": "dry", "high": "low", "rich": "poor",
    "loud": "quiet", "strong": "weak", "long": "short", "thick": "thin", "clean": "dirty", "left": "right",
}  # fmt: skip
COLORS = {
    "the sky": "blue", "grass": "green", "snow": "white", "coal": "black", "a banana": "yellow", "a tomato": "red",
    "an orange": "orange", "a carrot": "orange", "milk": "white", "a lemon": "yellow", "a strawberry": "red",
}  # fmt: skip
LEGS = {"dog": 4, "cat": 4, "spider": 8, "bird": 2, "ant": 6, "horse": 4, "chicken": 2, "bee": 6, "cow": 4}

ASKING = ["{}", "Quick question: {}", "Please tell me: {}", "{} Answer briefly.", "Can you tell me this? {}"]


def questions(rng: random.Random):
    """(question, answer) pairs of every kind, endlessly."""
    while True:
        kind = rng.randrange(7)
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        if kind == 0:
            yield f"What is {a} plus {b}?", a + b
        elif kind == 1:
            yield f"What is {a % 12 + 1} times {b % 12 + 1}?", (a % 12 + 1) * (b % 12 + 1)
        elif kind == 2:
            country = rng.choice(sorted(CAPITALS))
            yield f"What is the capital of {country}?", CAPITALS[country]
        elif kind == 3:
            word = rng.choice(sorted(OPPOSITES))
            yield f"What is the opposite of {word}?", OPPOSITES[word]
        elif kind == 4:
            thing = rng.choice(sorted(COLORS))
            yield f"What color is {thing}?", COLORS[thing]
        elif kind == 5:
            animal = rng.choice(sorted(LEGS))
            yield f"How many legs does a {animal} have?", LEGS[animal]
        else:
            yield f"Which number is larger, {a} or {b}?", max(a, b)


def records(count: int, rng: random.Random, seen: set[str]) -> list[dict]:
    """`count` chats whose questions are not in `seen` (which gains them)."""
    chats = []
    for question, answer in questions(rng):
        prompt = rng.choice(ASKING).format(question)
        if prompt in seen:
            continue
        seen.add(prompt)
        chats.append(
            {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": f"[[{answer}]]"}]}
        )
        if len(chats) == count:
            return chats


def main():
    rng, seen = random.Random(0), set()
    folder = Path(__file__).parent / "data"
    folder.mkdir(exist_ok=True)
    for split, count in (("train", 320), ("valid", 64)):
        lines = [json.dumps(record) for record in records(count, rng, seen)]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
