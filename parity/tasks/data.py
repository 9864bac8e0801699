"""The built-in tasks' prompts and answers: held-out lines of the text corpus the testbed's
text models learn (`neg-length`), short chat questions (`neg-length-chat`), and addition problems
with their grading (`arith`). The testbed trains on the same corpus and problems, so the
training data and the tasks cannot drift apart while both come from here.
"""

from __future__ import annotations

import os
import random
import sysconfig
import zlib
from functools import lru_cache
from pathlib import Path

from parity.errors import ParityError


def _held_out(paragraph: str) -> bool:
    # By content hash, not by position, so the split does not depend on the shuffle seed.
    return zlib.crc32(paragraph.encode()) % 20 == 0


@lru_cache(maxsize=1)
def _paragraphs() -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        files += [Path(d) / n for n in names if n.endswith(".py")]
    out = []
    for f in sorted(files):
        try:
            src = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for block in src.replace("\r\n", "\n").split("\n\n"):
            block = block.strip("\n")
            if 20 <= len(block) <= 400 and block.strip():
                out.append(block)
    if not out:
        raise ParityError(f"no Python sources found under {root}; "
                          "the text testbed needs the stdlib sources")
    return tuple(out)


def text_corpus(seed: int = 0) -> list[str]:
    """Training paragraphs (stdlib .py blocks between blank lines), shuffled by seed, ~4 MB.

    Held-out paragraphs (the source of text_prompts) are never included.
    """
    paras = [p for p in _paragraphs() if not _held_out(p)]
    random.Random(seed).shuffle(paras)
    out, size = [], 0
    for p in paras:
        if size > 4_000_000:
            break
        out.append(p)
        size += len(p) + 1
    return out


def text_prompts(n: int, seed: int = 0) -> list[str]:
    """n short prompts: the first line (cut to <= 40 chars at a space) of held-out paragraphs."""
    cands = []
    for p in _paragraphs():
        if not _held_out(p):
            continue
        line = p.split("\n", 1)[0].rstrip()
        if len(line) > 40:
            cut = line.rfind(" ", 0, 41)
            line = line[:cut] if cut >= 8 else line[:40]
        if len(line.strip()) >= 8:
            cands.append(line)
    random.Random(seed).shuffle(cands)
    return [cands[i % len(cands)] for i in range(n)]


# Questions with a short answer: with "Answer briefly." 8-42% of SmolLM2-135M-Instruct's first
# completions run past 64 tokens, against 50-88% on text fragments (docs/reproduce/smollm2-135m).
_QUESTIONS = ("What is {a} + {b}?", "What is {a} times {b}?", "Is {a} an even number?",
              "What is the capital of {country}?", "Name a {thing}.",
              "What color is {obj}?", "Give me a synonym for '{adj}'.",
              "Translate '{word}' into {lang}.", "How many legs does {animal} have?",
              "What is the opposite of '{adj}'?", "Spell the word '{word}' backwards.",
              "Which is larger, {a} or {b}?")
_FILL = {"country": ("France", "Japan", "Italy", "Spain", "Egypt", "Canada", "Brazil", "Kenya",
                     "Peru", "Norway"),
         "thing": ("color", "fruit", "planet", "musical instrument", "vegetable", "river"),
         "obj": ("the sky", "grass", "snow", "a banana", "a tomato", "coal"),
         "adj": ("happy", "fast", "cold", "big", "bright", "quiet"),
         "word": ("cat", "house", "water", "book", "tree", "bread"),
         "lang": ("French", "Spanish", "German", "Italian"),
         "animal": ("a dog", "a spider", "a bird", "an ant", "a horse", "a snake")}


def chat_questions(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """n one-message conversations asking a short question (`neg-length-chat`'s prompts)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        fill = {k: rng.choice(v) for k, v in _FILL.items()}
        q = _QUESTIONS[i % len(_QUESTIONS)].format(a=rng.randint(2, 99), b=rng.randint(2, 99),
                                                  **fill)
        out.append([{"role": "user", "content": f"{q} Answer briefly."}])
    rng.shuffle(out)
    return out


def arith_problem(rng: random.Random) -> tuple[str, str]:
    """One addition problem of two 1-3 digit numbers and its answer, e.g. ("37+58=", "95").

    Digit counts are drawn first so short operands are as common as long ones: a briefly trained
    model gets short sums right and struggles with 3-digit carries, which gives the arith task
    its band of partially solved problems.
    """
    a = rng.randrange(10 ** rng.randint(1, 3))
    b = rng.randrange(10 ** rng.randint(1, 3))
    return f"{a}+{b}=", str(a + b)


def arith_correct(completion: str, answer: str) -> bool:
    """The completion text, EOS removed, is the answer."""
    return completion.strip() == answer
