"""Chat prompts for training a drafter of an instruct model (`dflash-local corpus --chat`, `train --chat`).

An instruct model's answers are what its drafter must predict, so the data is its answers to user messages, rendered
through its own chat template. Three kinds, taking turns so any prefix of the list mixes them:

- code: a task on a snippet of the default corpus's code ("Explain what this code does", "Write a unit test for
  it", ...) or a small programming task in one of several languages;
- chat: a request on a paragraph of the default corpus's prose (summarise, explain, list the key points) or a
  request built from a topic and a kind of answer (a poem, tips, an explanation, a comparison);
- reasoning: arithmetic word problems with random numbers, solved step by step.

The building blocks below are our own; the held-out prompts in bench/chat-heldout.jsonl use other wordings and topics.
"""

from __future__ import annotations

import random

from .corpus import Prompt, default_corpus, interleave

OURS = "MIT"  # the licence of a generated prompt: this project's text

CODE_TASKS = (
    "Explain what this code does.", "Add comments to this code.", "Write a docstring for this.",
    "Complete this code.", "Is there a bug in this code? Explain.", "Rewrite this code more simply.",
    "Write a unit test for this code.", "What does each line of this code do?", "How could this code be faster?",
    "Describe the inputs and outputs of this code.",
)
LANGUAGES = ("Python", "JavaScript", "C", "Java", "Rust", "Go", "Bash", "SQL", "C++", "TypeScript")
PROGRAMS = (
    "reverses a string", "checks whether a number is prime", "sums the even numbers in a list",
    "counts the words in a text", "finds the largest element of an array", "merges two sorted lists",
    "computes the factorial of n", "removes duplicates from a list", "reads a file and prints its lines",
    "converts Celsius to Fahrenheit", "computes the n-th Fibonacci number", "checks whether a string is a palindrome",
    "sorts a list of names", "counts how often each character occurs", "finds the average of some numbers",
    "implements a stack", "implements binary search", "parses a date string", "validates an email address",
    "flattens a nested list", "computes the greatest common divisor of two numbers", "transposes a matrix",
)
PROSE_TASKS = (
    "Summarize this in two sentences.", "What is this about?", "Explain this to a beginner.",
    "List the key points of this text.", "Rewrite this in simpler words.", "What questions does this text answer?",
    "Translate this into plain English.", "Who would find this useful, and why?", "Write a title for this text.",
)
TOPICS = (
    "the ocean", "autumn", "a city at night", "friendship", "coffee", "mountains", "the moon", "a lost key",
    "gardening", "rain", "a train journey", "libraries", "winter mornings", "bees", "the desert", "music",
    "learning to cook", "a first job", "bicycles", "the stars", "a small village", "a thunderstorm", "old photographs",
    "running", "the internet", "volcanoes", "a rainy weekend", "birds", "chess", "the river", "public transport",
    "saving money", "learning a language", "sleep", "houseplants", "electric cars", "board games", "photography",
    "camping", "recycling", "time management", "the solar system", "dinosaurs", "ancient Rome", "honey", "bread",
    "a job interview", "moving to a new city", "meditation", "video games", "the human heart", "vaccines",
    "earthquakes", "the printing press", "coral reefs", "tea", "cats", "dogs", "penguins", "smartphones",
    "solar panels", "a birthday party", "a road trip", "painting", "knitting", "football", "swimming",
    "climate change", "the water cycle", "bridges", "lighthouses", "the first computers", "a museum visit",
)
ASKS = (
    "Write a short poem about {t}.", "Give me three tips about {t}.", "Write a short story about {t}.",
    "Tell me some interesting facts about {t}.", "Describe {t} in a few sentences.",
    "Write a haiku about {t}.", "Why do people like {t}?", "Write a short paragraph about {t} for children.",
    "What are the pros and cons of {t}?", "Explain {t} to a ten-year-old.", "Write a blog post introduction about {t}.",
    "What should a beginner know about {t}?", "Give me a fun quiz question about {t}.",
    "Write a tweet about {t}.", "Summarize the history of {t} briefly.",
    "What are common mistakes people make with {t}?",
    "Write a short dialogue between two friends about {t}.", "List five words that describe {t}.",
    "Write an email to a friend about {t}.", "What is a good first step to learn about {t}?",
)
THINGS = ("apples", "pencils", "books", "tickets", "marbles", "cookies", "stamps", "bottles of water", "notebooks",
          "oranges")
PEOPLE = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas")
PROBLEMS = (
    "{p} has {a} {x}. She buys {b} more and gives {c} to a friend. How many {x} does she have now?",
    "A shop sells {x} at {a} cents each. How much do {b} {x} cost in total?",
    "{p} reads {a} pages a day. How many days does it take to read a book of {n} pages?",
    "A train travels {a} km in {b} hours. What is its average speed?",
    "There are {a} {x} shared equally among {b} people. How many does each get, and how many are left over?",
    "{p} saves {a} dollars a week. How many weeks until {p} has {n} dollars?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
    "What is {a} times {b}, minus {c}?",
    "If {b} workers build a wall in {a} days, how long would {c} workers take at the same pace?",
)
SUFFIXES = ("", " Think step by step.", " Explain your reasoning.", " Show your work.")


def code_prompt(rng: random.Random, snippet: Prompt | None) -> Prompt:
    if snippet is not None and rng.random() < 0.6:
        return Prompt(f"{rng.choice(CODE_TASKS)}\n\n```\n{snippet.text}\n```", snippet.source, snippet.license, "code")
    return Prompt(f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(PROGRAMS)}.", "generated", OURS, "code")


def chat_prompt(rng: random.Random, paragraph: Prompt | None) -> Prompt:
    if paragraph is not None and rng.random() < 0.4:
        return Prompt(f"{rng.choice(PROSE_TASKS)}\n\n{paragraph.text}", paragraph.source, paragraph.license, "chat")
    return Prompt(rng.choice(ASKS).format(t=rng.choice(TOPICS)), "generated", OURS, "chat")


def reasoning_prompt(rng: random.Random) -> Prompt:
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(1, 20)
    text = rng.choice(PROBLEMS).format(p=rng.choice(PEOPLE), x=rng.choice(THINGS), a=a, b=b, c=c,
                                       n=a * rng.randint(3, 30))
    return Prompt(text + rng.choice(SUFFIXES), "generated", OURS, "reasoning")


def chat_corpus(seed: int = 0, n: int | None = None) -> list[Prompt]:
    """User messages of the three kinds, in turn (n: the first n); each code and prose snippet of the default corpus
    is used once, so at most that many of each kind. Exact duplicates are dropped."""
    rng = random.Random(seed)
    base = default_corpus(seed)
    code = [p for p in base if p.kind == "code"]
    prose = [p for p in base if p.kind == "prose"]
    n_each = min(len(code), len(prose))
    out: dict[str, Prompt] = {}
    kinds: list[list[Prompt]] = [[], [], []]
    for i in range(n_each):
        made = (code_prompt(rng, code[i] if i < len(code) else None),
                chat_prompt(rng, prose[i] if i < len(prose) else None), reasoning_prompt(rng))
        for k, m in enumerate(made):
            if m.text not in out:
                out[m.text] = m
                kinds[k].append(m)
    rows = interleave(kinds)
    return rows[:n] if n is not None else rows
