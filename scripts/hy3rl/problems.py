r"""One problem's text as the held-out checks compare it (issue 27, item 6).

Two prompts hold the same problem when their normalised keys are equal
(:func:`normalise`): the last user message, with

- unicode super- and subscripts written as ``^n`` / ``_n`` (``x²`` = ``x^2``), braces around
  a plain exponent or index dropped (``x^{2}`` = ``x^2``), then NFKC and case folding;
- LaTeX math delimiters ``\(`` ``\)`` ``\[`` ``\]`` ``$$`` ``$`` (and ``\$``) removed
  (``\(x\)`` = ``$x$`` = ``x``), ``\dfrac`` / ``\tfrac`` read as ``\frac``, ``\left`` /
  ``\right`` and LaTeX spacing commands removed;
- split into tokens (runs of letters and digits, each other symbol alone): whitespace is
  not part of the key (``x^2 = 4`` = ``x^2=4``);
- punctuation at either end removed (a dropped final period), and the instruction
  wrappers of :data:`WRAPPERS` peeled off its start and end, in any spacing, case or end
  punctuation, as often as they occur.

Problems not equal after that are near-duplicates when the Jaccard similarity of their
word 3-gram sets (words: the letter/digit tokens) is at least :data:`NEAR_DUPLICATE_JACCARD`.
:class:`NgramIndex` finds them through an index (3-gram -> problems) rather than over all
pairs.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hy3rl.data import DAPO_PREFIX, DAPO_SUFFIX

# (prefix, suffix) around a problem in the prompt templates in use, as written by them.
WRAPPERS: tuple[tuple[str, str], ...] = (
    # DAPO-Math-17k and BytedTsinghua-SIA/AIME-2024 (hy3rl.data, convert.template: dapo)
    (DAPO_PREFIX, DAPO_SUFFIX),
    # verl examples/data_preprocess/math_dataset.py (MATH) and many AIME/MATH evaluations
    ("", "Let's think step by step and output the final answer within \\boxed{}."),
    # verl examples/data_preprocess/gsm8k.py
    ("", 'Let\'s think step by step and output the final answer after "####".'),
    # DeepSeek-R1 / Qwen2.5-Math evaluation prompt
    ("", "Please reason step by step, and put your final answer within \\boxed{}."),
    ("", "Please output the final answer within \\boxed{}."),
)
NEAR_DUPLICATE_JACCARD = 0.7
NGRAM = 3

_SUPER = dict(zip("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁼⁽⁾ⁿⁱ", "0123456789+-=()ni", strict=True))
_SUB = dict(zip("₀₁₂₃₄₅₆₇₈₉₊₋₌₍₎ₐₑₒₓₕₖₗₘₙₚₛₜ", "0123456789+-=()aeoxhklmnpst", strict=True))
_SUPER_RUN = re.compile(f"[{''.join(_SUPER)}]+")
_SUB_RUN = re.compile(f"[{''.join(_SUB)}]+")
_BRACED_SCRIPT = re.compile(r"([\^_])\{(\w+)\}")
_LATEX = [
    (re.compile(r"\\[dt]frac(?![a-z])"), r"\\frac"),
    (re.compile(r"\\(?:left|right)(?![a-z])|\\[,;:! ]"), " "),
    (re.compile(r"\\[()\[\]]|\\?\$"), " "),  # math delimiters ($$, and \$ as $)
]
_TOKEN = re.compile(r"\w+|[^\w\s]")


def _tokens(text: str) -> list[str]:
    text = _SUPER_RUN.sub(lambda m: "^" + "".join(_SUPER[c] for c in m.group()), text)
    text = _SUB_RUN.sub(lambda m: "_" + "".join(_SUB[c] for c in m.group()), text)
    text = unicodedata.normalize("NFKC", text).casefold()
    for pattern, repl in _LATEX:
        text = pattern.sub(repl, text)
    text = _BRACED_SCRIPT.sub(r"\1\2", text)
    return _TOKEN.findall(text)


def _trim(toks: list[str]) -> list[str]:
    """Without the punctuation tokens at either end."""
    lo, hi = 0, len(toks)
    while lo < hi and not toks[lo][0].isalnum():
        lo += 1
    while hi > lo and not toks[hi - 1][0].isalnum():
        hi -= 1
    return toks[lo:hi]


_WRAPPER_TOKENS = [(_trim(_tokens(p)), _trim(_tokens(s))) for p, s in WRAPPERS]


def normalise(text: str) -> list[str]:
    """The tokens of one problem's text, normalised (see the module doc); their join is the
    problem's key."""
    text = text.strip()
    for pre, suf in WRAPPERS:  # as written: cheap, and most prompts carry one so
        if pre and text.startswith(pre):
            text = text[len(pre):].lstrip()
        if suf and text.endswith(suf):
            text = text[:-len(suf)].rstrip()
    toks = _trim(_tokens(text))
    peeled = True
    while peeled:  # any spacing, case or end punctuation of a wrapper, as often as it occurs
        peeled = False
        for pre, suf in _WRAPPER_TOKENS:
            for part, at_start in ((pre, True), (suf, False)):
                n = len(part)
                if n and len(toks) > n and (toks[:n] if at_start else toks[-n:]) == part:
                    toks = _trim(toks[n:] if at_start else toks[:-n])
                    peeled = True
    return toks


def problem_key(text: str) -> str:
    """The key two texts of the same problem share."""
    return "".join(normalise(text))


def user_text(prompt: Any) -> str:
    """The last user message of one verl ``prompt`` (a list of messages)."""
    content = ""
    for msg in prompt or []:
        if isinstance(msg, Mapping) and msg.get("role") == "user":
            content = str(msg.get("content") or "")
    return content


def shown(text: str, limit: int = 300) -> str:
    """A problem's text for a message: the wrappers' own text removed, whitespace folded,
    at most ``limit`` characters."""
    for pre, suf in WRAPPERS:
        for cut in (pre, suf):
            if cut:
                text = text.replace(cut, " ")
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


@dataclass(frozen=True)
class Problem:
    """One distinct problem of a file: its key, id and row (of its first occurrence), the
    text as written and its word 3-grams."""

    key: str
    pid: str
    row: int
    text: str
    ngrams: frozenset[tuple[str, ...]]


def problem(text: str, pid: str, row: int) -> Problem:
    toks = normalise(text)
    words = [t for t in toks if t[0].isalnum()]
    grams = (frozenset(zip(*(words[i:] for i in range(NGRAM)), strict=False))
             if len(words) >= NGRAM else frozenset([tuple(words)]))
    return Problem("".join(toks), pid, row, text, grams)


@dataclass(frozen=True)
class NearDuplicate:
    mine: Problem
    theirs: Problem
    jaccard: float


class NgramIndex:
    """Word 3-gram -> the indexed problems holding it; :meth:`near` finds, for each indexed
    problem, the most similar of a stream of others at or above ``threshold`` (never one
    with an equal key) by counting shared 3-grams through the index."""

    def __init__(self, problems: Iterable[Problem],
                 threshold: float = NEAR_DUPLICATE_JACCARD) -> None:
        self.problems = list(problems)
        self.threshold = threshold
        self.index: dict[tuple[str, ...], list[int]] = {}
        for i, p in enumerate(self.problems):
            for g in p.ngrams:
                self.index.setdefault(g, []).append(i)

    def near(self, others: Iterable[Problem]) -> list[NearDuplicate]:
        best: dict[int, NearDuplicate] = {}
        for other in others:
            shared = Counter(i for g in other.ngrams for i in self.index.get(g, ()))
            for i, inter in shared.items():
                mine = self.problems[i]
                if mine.key == other.key:
                    continue
                jac = inter / (len(mine.ngrams) + len(other.ngrams) - inter)
                if jac >= self.threshold and (i not in best or jac > best[i].jaccard):
                    best[i] = NearDuplicate(mine, other, jac)
        return [best[i] for i in sorted(best)]
