"""Instruction prompts made here, for self-distillation when no dataset is at hand: tasks x topics.

The topics are split in two: prompts for training draw on one part, `held_out_prompts` on the other, so an
evaluation never sees a topic the drafter was trained on.
"""
from __future__ import annotations

import random

TASKS = (
    "Explain {t} to a curious twelve-year-old.",
    "Write a short story that involves {t}.",
    "Give me five practical tips about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Summarize the history of {t} in one paragraph.",
    "Write a haiku about {t}.",
    "Describe {t} in three sentences.",
    "What is a common misconception about {t}? Explain why it is wrong.",
    "Write an email to a friend recommending {t}.",
    "List the key terms someone should know about {t}, with a one-line definition each.",
    "Compare {t} with something similar and explain the differences.",
    "Write a step-by-step guide for a beginner interested in {t}.",
    "What questions would an expert ask about {t}? Answer two of them.",
    "Write a persuasive paragraph arguing that {t} deserves more attention.",
    "Create a short quiz with three questions about {t}, and give the answers.",
    "Tell me a fun fact about {t} and explain it.",
)
CODE_TASKS = (
    "Write a Python function that {c}.",
    "Explain, with a short code example, how to {c} in Python.",
    "Write a JavaScript function that {c}, and explain how it works.",
)
TOPICS = (
    "photosynthesis", "black holes", "the Roman Empire", "machine learning", "volcanoes", "jazz music",
    "the water cycle", "electric cars", "honeybees", "the French Revolution", "quantum computing", "coffee",
    "climate change", "the human immune system", "chess", "the Moon landing", "bread baking", "recycling",
    "the stock market", "dinosaurs", "meditation", "the Internet", "earthquakes", "origami", "the Olympic Games",
    "vaccines", "renewable energy", "the printing press", "octopuses", "public libraries", "rainforests",
    "cryptography", "marathon running", "the Great Wall of China", "gardening", "plate tectonics", "opera",
    "time zones", "solar panels", "the Renaissance", "sleep", "bicycles", "the periodic table", "glaciers",
    "video games", "democracy", "tea ceremonies", "coral reefs", "the Silk Road", "3D printing", "penguins",
    "supply chains", "the theory of evolution", "mountaineering", "architecture", "nutrition", "wind turbines",
    "ancient Egypt", "sign language", "robotics", "bird migration", "the stock exchange", "urban planning",
    "photography", "the speed of light", "fermentation", "volunteering", "the Amazon river", "board games",
    "antibiotics", "space telescopes", "minimalism", "the Industrial Revolution", "sharks", "public speaking",
    "composting", "the human brain", "submarines", "poetry", "desert ecosystems", "electric guitars",
)
CODE_TOPICS = (
    "reverses a string", "checks whether a number is prime", "merges two sorted lists", "counts word frequencies",
    "finds the longest common prefix of a list of strings", "computes the Fibonacci numbers up to n",
    "removes duplicates from a list while keeping order", "parses a CSV line", "flattens a nested list",
    "validates an email address", "converts Celsius to Fahrenheit", "computes the median of a list",
    "checks whether a string is a palindrome", "sorts a dictionary by value", "reads a file line by line",
    "implements binary search", "computes the factorial of a number", "groups items by a key",
    "finds the most common element in a list", "rotates a matrix by 90 degrees",
)
HELD_OUT_EVERY = 5   # every fifth topic is kept out of training


def _prompts(topics: tuple[str, ...], code_topics: tuple[str, ...]) -> list[str]:
    return [task.format(t=t) for t in topics for task in TASKS] + \
        [task.format(c=c) for c in code_topics for task in CODE_TASKS]


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """n instructions on the training topics (cycled, each pass reshuffled, when n exceeds them)."""
    pool = _prompts(tuple(t for i, t in enumerate(TOPICS) if i % HELD_OUT_EVERY),
                    tuple(c for i, c in enumerate(CODE_TOPICS) if i % HELD_OUT_EVERY))
    return _take(pool, n, seed)


def held_out_prompts(n: int, seed: int = 0) -> list[str]:
    """n instructions on topics no training prompt uses."""
    pool = _prompts(TOPICS[::HELD_OUT_EVERY], CODE_TOPICS[::HELD_OUT_EVERY])
    return _take(pool, n, seed)


def _take(pool: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        batch = list(pool)
        rng.shuffle(batch)
        out.extend(batch[:n - len(out)])
    return out
