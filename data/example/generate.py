"""Generates the embedded example dataset (deterministic) in four raw formats, one per category.

    python -m data.example.generate        # rewrites data/example/raw/*

math   — prompt/response columns (`question` / `answer`), single turn, step-by-step arithmetic
code   — OpenAI `messages`, two turns (write a function, then change it)
chat   — ShareGPT `conversations`, one to three turns of small talk and facts
tools  — `messages` with `tools` and assistant `tool_calls` answered by `tool` messages
"""
from __future__ import annotations

import random
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
RAW = HERE / "raw"

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jonas", "Kofi", "Lena"]
ITEMS = ["apples", "pencils", "marbles", "stickers", "books", "cookies", "shells", "coins"]
CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Hanoi", "Quito", "Perth", "Seoul"]
FACTS = {
    "Why is the sky blue?": "Sunlight is scattered by the air, and blue light is scattered the most, "
    "so the sky looks blue from every direction.",
    "What is photosynthesis?": "Photosynthesis is how plants use sunlight, water and carbon dioxide to make "
    "sugar and release oxygen.",
    "How far is the Moon?": "The Moon is about 384,400 kilometres from Earth on average.",
    "What is a prime number?": "A prime number is a whole number above 1 whose only divisors are 1 and itself, "
    "such as 2, 3, 5 and 7.",
    "Why do we have seasons?": "Earth's axis is tilted, so each hemisphere gets more direct sunlight for part "
    "of the year and less for the rest.",
    "What is the boiling point of water?": "At sea level water boils at 100 degrees Celsius (212 Fahrenheit).",
}
GREETINGS = ["Hi!", "Hello there.", "Good morning!", "Hey, how are you?", "Hallo! Wie geht's?", "你好！"]
REPLIES = [
    "Hello! I'm doing well, thank you. How can I help you today?",
    "Hi! Happy to help. What would you like to talk about?",
    "Good to see you. Ask me anything.",
]


def math_record(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 40), rng.randint(2, 9)
    question = (
        f"{name} has {a} {item}. A friend gives {name} {b} more, and then {name} shares them equally "
        f"among {c} boxes, putting the leftovers aside. How many {item} are in each box?"
    )
    total = a + b
    per_box, rest = divmod(total, c)
    answer = (
        f"{name} starts with {a} {item} and gets {b} more: {a} + {b} = <<{a}+{b}={total}>>{total}.\n"
        f"Sharing {total} among {c} boxes: {total} // {c} = <<{total}//{c}={per_box}>>{per_box}, "
        f"with {rest} left over.\n#### {per_box}"
    )
    return {"question": question, "answer": answer}


def code_record(rng: random.Random) -> dict:
    n = rng.randint(2, 9)
    op, sym = rng.choice([("add", "+"), ("multiply", "*"), ("subtract", "-")])
    fname = f"{op}_{n}"
    first = f"def {fname}(x):\n    return x {sym} {n}\n"
    second = f"def {fname}(values):\n    return [v {sym} {n} for v in values]\n"
    return {
        "messages": [
            {"role": "system", "content": "You are a careful Python programmer."},
            {"role": "user", "content": f"Write a Python function `{fname}` that returns x {sym} {n}."},
            {"role": "assistant", "content": f"```python\n{first}```"},
            {"role": "user", "content": "Now make it work on a list of numbers."},
            {"role": "assistant", "content": f"```python\n{second}```\nIt applies the same operation to every item."},
        ]
    }


def chat_record(rng: random.Random) -> dict:
    turns = [("human", rng.choice(GREETINGS)), ("gpt", rng.choice(REPLIES))]
    for question in rng.sample(sorted(FACTS), rng.randint(0, 2)):
        turns += [("human", question), ("gpt", FACTS[question])]
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}


def tools_record(rng: random.Random) -> dict:
    city = rng.choice(CITIES)
    temp = rng.randint(-5, 35)
    sky = rng.choice(["sunny", "cloudy", "rainy", "windy"])
    return {
        "messages": [
            {"role": "user", "content": f"What's the weather like in {city}?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city, "unit": "C"}}}
                ],
            },
            {"role": "tool", "content": orjson.dumps({"temp": temp, "sky": sky}).decode()},
            {"role": "assistant", "content": f"It is {temp}°C and {sky} in {city} right now."},
        ],
        "tools": [WEATHER_TOOL],
    }


def generate(seed: int = 0) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    return {
        "math.jsonl": [math_record(rng) for _ in range(160)],
        "code.jsonl": [code_record(rng) for _ in range(90)],
        "chat.json": [chat_record(rng) for _ in range(100)],
        "tools.jsonl": [tools_record(rng) for _ in range(60)],
    }


def main() -> None:
    RAW.mkdir(exist_ok=True)
    for name, rows in generate().items():
        if name.endswith(".jsonl"):
            data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
        else:
            data = orjson.dumps(rows, option=orjson.OPT_INDENT_2)
        (RAW / name).write_bytes(data)
        print(f"{RAW / name}: {len(rows)} records")


if __name__ == "__main__":
    main()
