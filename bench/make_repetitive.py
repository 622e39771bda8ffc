"""Writes bench/repetitive.jsonl: a stream of requests that share structure across each other, as
agent and extraction traffic does, for the drafters that learn from past requests (`suffix`).

Four families, shuffled into one stream (seeded, so the file is reproducible):
- extraction: a person's details from a sentence, answered as JSON with fixed keys;
- classification: a review's sentiment with a one-sentence reason, in a fixed answer form;
- sql: a query over one table schema, for a question built from a template;
- tool calls: a weather/booking agent's conversation so far, asking for the next tool call as JSON.

Every prompt is different (names, numbers, cities, products and phrasing vary); what repeats is
the frame of the answer. The data is generated here: nothing is downloaded.

    python bench/make_repetitive.py            # writes bench/repetitive.jsonl (240 requests)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

FIRST = ["Maria", "John", "Aisha", "Wei", "Lucas", "Fatima", "Ivan", "Sofia", "Kenji", "Amara", "Diego", "Hannah",
         "Omar", "Elena", "Ravi", "Chloe", "Mateo", "Yuki", "Noah", "Leila", "Tom", "Priya", "Jonas", "Zara"]
LAST = ["Lopez", "Smith", "Khan", "Chen", "Silva", "Haddad", "Petrov", "Rossi", "Tanaka", "Okafor", "Garcia",
        "Muller", "Ali", "Novak", "Patel", "Martin", "Fernandez", "Sato", "Brown", "Karimi", "Jensen", "Dubois"]
CITIES = ["Madrid", "Chicago", "Lagos", "Shanghai", "Lisbon", "Beirut", "Kazan", "Milan", "Osaka", "Nairobi",
          "Lima", "Berlin", "Cairo", "Prague", "Pune", "Lyon", "Bogota", "Sapporo", "Denver", "Tehran", "Oslo"]
JOBS = ["nurse", "teacher", "software engineer", "chef", "architect", "pilot", "accountant", "plumber",
        "photographer", "pharmacist", "electrician", "journalist", "lawyer", "baker", "dentist", "librarian"]
PRODUCTS = ["headphones", "blender", "running shoes", "laptop bag", "coffee maker", "desk lamp", "phone case",
            "backpack", "electric kettle", "yoga mat", "smartwatch", "air fryer", "office chair", "umbrella"]
GOOD = ["works perfectly", "arrived early and well packed", "is worth every penny", "exceeded my expectations",
        "is sturdy and easy to use", "has great battery life", "looks even better than the photos"]
BAD = ["broke after two days", "arrived damaged", "is much smaller than described", "stopped working quickly",
       "feels cheap and flimsy", "was missing parts", "is far too noisy"]
MEH = ["does the job but nothing special", "is okay for the price", "works as described, no more",
       "is average, neither good nor bad", "is fine but the color is a bit off"]
DEPTS = ["sales", "engineering", "marketing", "finance", "support", "legal", "operations", "research"]


def person(rng: random.Random) -> tuple[str, int, str, str]:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}", rng.randint(19, 74), rng.choice(CITIES), rng.choice(JOBS)


def extraction(rng: random.Random) -> str:
    name, age, city, job = person(rng)
    sentence = rng.choice([
        f"{name} is a {age}-year-old {job} who lives in {city}.",
        f"Living in {city}, {name} ({age}) works as a {job}.",
        f"At {age}, {name} moved to {city} and now works as a {job}.",
        f"Our new {job}, {name}, is {age} years old and based in {city}.",
    ])
    return ("Extract the person's details from the text. Answer only with JSON in the form "
            '{"name": ..., "age": ..., "city": ..., "job": ...}.\n\n'
            f"Text: {sentence}")


def classification(rng: random.Random) -> str:
    product = rng.choice(PRODUCTS)
    kind = rng.choice([GOOD, BAD, MEH])
    review = f"The {product} I bought {rng.choice(kind)}"
    if rng.random() < 0.5:
        review += f", and delivery took {rng.randint(1, 14)} days"
    return ("Classify the sentiment of the review as positive, negative or neutral. Answer in exactly two lines:\n"
            "Sentiment: <positive|negative|neutral>\nReason: <one short sentence>\n\n"
            f"Review: {review}.")


SCHEMA = ("CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT, department TEXT, salary INTEGER, "
          "city TEXT, hire_year INTEGER);")


def sql(rng: random.Random) -> str:
    dept, city = rng.choice(DEPTS), rng.choice(CITIES)
    question = rng.choice([
        f"the names of employees in the {dept} department who earn more than {rng.randint(3, 15) * 10000}",
        f"how many employees work in {city}",
        f"the average salary of the {dept} department",
        f"the names and salaries of employees hired after {rng.randint(2005, 2023)}, highest salary first",
        f"the number of employees per department in {city}",
        f"the three best-paid employees of the {dept} department",
    ])
    return f"Given this table:\n{SCHEMA}\n\nWrite one SQL query that returns {question}. Answer with the query only."


TOOLS = ('You can call these tools, one per answer, as JSON {"tool": <name>, "arguments": {...}}:\n'
         '- get_weather(city: string, date: string)\n'
         '- find_hotels(city: string, max_price: integer)\n'
         '- book_hotel(hotel_id: string, nights: integer)\n')


def tool_call(rng: random.Random) -> str:
    """A conversation of 1-3 earlier calls and their results, then the user's next need."""
    city = rng.choice(CITIES)
    day = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    budget = rng.randint(6, 30) * 10
    hotel = f"H{rng.randint(100, 999)}"
    turns = [
        (f'{{"tool": "get_weather", "arguments": {{"city": "{city}", "date": "{day}"}}}}',
         f'{{"city": "{city}", "forecast": "{rng.choice(["sunny", "rain", "cloudy", "snow"])}", '
         f'"high_c": {rng.randint(-5, 35)}}}'),
        (f'{{"tool": "find_hotels", "arguments": {{"city": "{city}", "max_price": {budget}}}}}',
         f'{{"hotels": [{{"id": "{hotel}", "price": {budget - rng.randint(1, 5) * 5}}}]}}'),
    ]
    done = rng.randint(0, 2)
    history = "".join(f"Assistant: {call}\nTool result: {result}\n" for call, result in turns[:done])
    asks = [f"What will the weather be in {city} on {day}?",
            f"Find me a hotel in {city} under {budget} euros a night.",
            f"Book hotel {hotel} for {rng.randint(1, 9)} nights."]
    return f"{TOOLS}\nUser: {asks[0]} {' '.join(asks[1:done + 1])}\n{history}Next tool call for: {asks[done]}"


FAMILIES = (extraction, classification, sql, tool_call)


def build(num_requests: int, seed: int) -> list[dict[str, str]]:
    """num_requests distinct prompts, the families shuffled together."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < num_requests:
        family = FAMILIES[len(rows) % len(FAMILIES)] if rng.random() < 0.5 else rng.choice(FAMILIES)
        prompt = family(rng)
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "family": family.__name__})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=240)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).with_name("repetitive.jsonl")))
    args = p.parse_args()
    rows = build(args.num_requests, args.seed)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} requests -> {args.out}")


if __name__ == "__main__":
    main()
