"""Copy-heavy workloads, the case prompt lookup (n-gram speculative decoding) is for: chat prompts whose greedy answers
quote long spans of the prompt. Deterministic for a seed, tokenized with the model's chat template.

copy: passages and Python functions assembled from templates ("repeat this text", "rename this variable");
real-text: English prose of the Python language reference that ships with the interpreter (pydoc_data.topics, the
same text for one Python version), sliced into passages by the seed.
novel: the opposite case, open-ended requests (a story, an explanation) whose answers quote nothing: what proposals
cost where they are seldom right, the measure of when speculation should step back.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from benchmarks.common.bench_request import BenchRequest

REPEAT = "Repeat the following text exactly, then stop:"
RENAME = "Here is a Python function. Rewrite it with the variable `x` renamed to `value`:"

NAMES = ("Ada", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Keiko", "Luis",
         "Marta", "Nils", "Olga", "Pavel")
PLACES = ("the harbour", "the north warehouse", "the old mill", "the river dock", "the market square",
          "the east gate", "the bakery on Elm Street", "the customs house", "the lighthouse", "the rail yard")
ITEMS = ("crates of apples", "barrels of oil", "bolts of linen", "sacks of flour", "coils of rope", "boxes of nails",
         "jars of honey", "bales of wool", "cases of lamps", "rolls of paper")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
SENTENCES = (
    "{name} carried {n} {item} from {place} to {place2} on {day}.",
    "By {hour} o'clock the ferry to {place} had taken {n} passengers and {m} {item}.",
    "{name} wrote in the ledger that {n} {item} were missing from {place}.",
    "The inspector counted {n} {item} at {place} and sent the report to {name2}.",
    "On {day}, {name} and {name2} repaired the gate at {place} before the rain came.",
    "Nobody at {place} remembered who had ordered {m} {item}, so {name} asked again.",
    "{name2} paid {n} coins for {m} {item} and stored them at {place2}.",
    "The storm on {day} closed {place} for {m} hours, and {name} waited at {place2}.",
)

VERBS = ("scale", "count", "merge", "filter", "collect", "measure", "sum", "shift")
NOUNS = ("prices", "samples", "orders", "weights", "readings", "scores", "offsets", "tickets")
ARGS = ("factor", "items", "limit", "step", "table", "rate")
ACCUMULATORS = ("total", "result", "acc", "out", "seen")
LOOP_NAMES = ("i", "k", "item", "entry", "n")
FUNCTIONS = (
    'def {verb}_{noun}(x, {arg}):\n'
    '    """Return the {noun} up to x, scaled by {arg}."""\n'
    '    {acc} = {n}\n'
    '    for {loop} in range(x):\n'
    '        if {loop} % {m} == 0:\n'
    '            {acc} += {loop} * {arg}\n'
    '    return {acc} + x\n',
    'def {verb}_{noun}(x, {arg}):\n'
    '    {acc} = []\n'
    '    while x > {n}:\n'
    '        {acc}.append(x * {arg})\n'
    '        x = x // {m}\n'
    '    return {acc}\n',
    'def {verb}_{noun}({arg}, x):\n'
    '    if x is None:\n'
    '        return {n}\n'
    '    {acc} = {{}}\n'
    '    for {loop} in {arg}:\n'
    '        {acc}[{loop}] = x + {loop} * {m}\n'
    '    return {acc}\n',
    'def {verb}_{noun}(x, {arg}={n}):\n'
    '    """{noun} of x, {arg} at a time."""\n'
    '    {acc} = [x[{loop}:{loop} + {arg}] for {loop} in range(0, len(x), {arg})]\n'
    '    if len({acc}) > {m}:\n'
    '        {acc} = {acc}[:{m}]\n'
    '    return [sum(part) for part in {acc}]\n',
)


@dataclass(frozen=True)
class CopyPrompt:
    instruction: str
    passage: str      # what a faithful answer quotes

    @property
    def message(self) -> str:
        return f"{self.instruction}\n\n{self.passage}" if self.passage else self.instruction


def synthetic_passage(rng: random.Random, sentences: int) -> str:
    def sentence() -> str:
        name, name2 = rng.sample(NAMES, 2)
        place, place2 = rng.sample(PLACES, 2)
        return rng.choice(SENTENCES).format(name=name, name2=name2, place=place, place2=place2,
                                            item=rng.choice(ITEMS), day=rng.choice(DAYS), n=rng.randint(2, 990),
                                            m=rng.randint(2, 90), hour=rng.randint(1, 12))
    return " ".join(sentence() for _ in range(sentences))


def synthetic_function(rng: random.Random) -> str:
    return rng.choice(FUNCTIONS).format(verb=rng.choice(VERBS), noun=rng.choice(NOUNS), arg=rng.choice(ARGS),
                                        acc=rng.choice(ACCUMULATORS), loop=rng.choice(LOOP_NAMES),
                                        n=rng.randint(0, 99), m=rng.randint(2, 9))


def synthetic_prompts(num_requests: int, seed: int = 0) -> list[CopyPrompt]:
    """Alternately a passage to repeat (6 to 9 sentences) and a function to rewrite with `x` renamed."""
    rng = random.Random(seed)
    return [CopyPrompt(REPEAT, synthetic_passage(rng, rng.randint(6, 9))) if i % 2 == 0
            else CopyPrompt(RENAME, f"```python\n{synthetic_function(rng)}```") for i in range(num_requests)]


def prose_paragraphs(min_words: int = 30, max_words: int = 150) -> list[str]:
    """The reference's paragraphs that are prose: unindented, no grammar rules, no headings; one line each."""
    from pydoc_data.topics import topics

    paragraphs = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            prose = block.rstrip().endswith(".") and "::=" not in block and ">>>" not in block
            if block.startswith((" ", "-", "*")) or not prose:
                continue
            text = " ".join(block.split())
            if min_words <= len(text.split()) <= max_words:
                paragraphs.append(text)
    return paragraphs


def real_text_prompts(num_requests: int, seed: int = 0, words: int = 110) -> list[CopyPrompt]:
    """Passages of consecutive prose paragraphs from a seeded start, at least `words` long."""
    rng = random.Random(seed)
    paragraphs = prose_paragraphs()
    prompts = []
    for _ in range(num_requests):
        start = rng.randrange(len(paragraphs))
        passage = [paragraphs[start]]
        while sum(len(p.split()) for p in passage) < words:
            passage.append(paragraphs[(start + len(passage)) % len(paragraphs)])
        prompts.append(CopyPrompt(REPEAT, "\n\n".join(passage)))
    return prompts


NOVEL = ("Write a short story about {name}, who works at {place}.",
         "Explain to a child why {item} are useful, in a few paragraphs.",
         "Describe a busy {day} at {place} from the point of view of {name}.",
         "Write a letter from {name} to {name2} about the {item} that went missing.")


def novel_prompts(num_requests: int, seed: int = 0) -> list[CopyPrompt]:
    """Open-ended requests from templates, all different: nothing in them to quote."""
    rng = random.Random(seed)
    requests: dict[str, None] = {}
    while len(requests) < num_requests:
        requests[rng.choice(NOVEL).format(name=rng.choice(NAMES), name2=rng.choice(NAMES), place=rng.choice(PLACES),
                                          item=rng.choice(ITEMS), day=rng.choice(DAYS))] = None
    return [CopyPrompt(request, "") for request in requests]


PROMPTS = {"copy": synthetic_prompts, "real-text": real_text_prompts, "novel": novel_prompts}


def chat_requests(prompts: list[CopyPrompt], tokenizer, max_tokens: int) -> list[BenchRequest]:
    """Each prompt as the user's turn of the tokenizer's chat template, the assistant's turn opened."""
    requests = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.message}],
                                             add_generation_prompt=True, tokenize=False)
        requests.append(BenchRequest(tokenizer(text, add_special_tokens=False).input_ids, max_tokens))
    return requests


def load(name: str, tokenizer, num_requests: int, max_tokens: int = 128, seed: int = 0) -> list[BenchRequest]:
    if name not in PROMPTS:
        raise ValueError(f"unknown copy workload {name!r}: one of {', '.join(PROMPTS)}")
    return chat_requests(PROMPTS[name](num_requests, seed), tokenizer, max_tokens)
