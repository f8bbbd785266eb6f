"""Word categories of tokens for the group inspection (``focus inspect``): a transparent
lexical categorisation, not a tagger.

Why not a tagger: the maintained English taggers need model data that the package
registries do not serve (spaCy's English pipelines are published outside PyPI, NLTK's
perceptron tagger and Stanza/Flair models are downloaded at run time); PyPI re-uploads of
spaCy pipelines by third parties exist but are not kept by spaCy's authors. So every token
gets the category of its *word* by the fixed rules below, without context.

Categories (:data:`CATEGORIES`, checked in this order on the word):

* ``special``: a special token of the tokenizer (BOS, EOS between documents, padding);
* ``newline``: whitespace containing a line break; ``space``: other whitespace;
* ``punct``: only punctuation and symbols (Unicode categories ``P*`` and ``S*``);
* ``number``: contains a digit, or a cardinal number word (``one`` .. ``ninety``,
  ``hundred``, ``thousand``, ``million``);
* the closed word classes of the Universal Dependencies part-of-speech tagset (UPOS, UD v2,
  https://universaldependencies.org/u/pos/), with English word lists written for this
  module after the conventions of the UD English Web Treebank: ``det`` (articles,
  demonstratives and quantifying determiners), ``adp`` (prepositions), ``pron`` (personal,
  possessive - UD tags *my*, *his*, *her* as PRON -, reflexive, wh- and indefinite
  pronouns), ``aux`` (forms of *be*, *have*, *do* and the modals, and the clitics 'll 're
  've 'd 'm), ``cconj`` (coordinating conjunctions), ``sconj`` (subordinating
  conjunctions), ``part`` (*not*, n't, possessive 's); the lists are compared lower-cased;
* ``capitalised``: any other word that starts with an upper-case letter (names, and
  open-class words at the start of a sentence);
* ``other``: the rest (lower-case open-class words: nouns, verbs, adjectives, adverbs).

Without context a word has one class: a word that UD tags differently by use gets the class
of its most common use in English prose as judged for this list, namely *that*, *as*,
*than* -> ``sconj``; *to*, *before*, *after*, *since*, *until* -> ``adp``; *which*, *what*
-> ``pron``; *one* -> ``number``; *be*, *have*, *do* (also as main verbs) -> ``aux``; 's ->
``part`` (also when it stands for *is* or *has*).

Sub-word tokens: a token that continues a word (it starts with a letter or digit, without
leading space, right after a token that ends with one) belongs to that word and gets the
word's category; :func:`token_categories` also returns which tokens are such
continuations, so that their share can be reported apart.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CATEGORIES",
    "CLOSED_CLASSES",
    "NUMBER_WORDS",
    "token_categories",
    "token_texts",
    "word_category",
]

#: every category, in the order of the rules (module docstring)
CATEGORIES = (
    "special",
    "newline",
    "space",
    "punct",
    "number",
    "det",
    "adp",
    "pron",
    "aux",
    "cconj",
    "sconj",
    "part",
    "capitalised",
    "other",
)

_CARDINALS = (
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety "
    "hundred thousand million"
)
#: cardinal number words (category ``number``)
NUMBER_WORDS = frozenset(_CARDINALS.split())

_LISTS = {
    "det": "a an the this these those each every either neither some any no all both another",
    "adp": "about above across after against along amid amidst among amongst around at before "
    "behind below beneath beside besides between beyond by despite down during except for "
    "from in inside into near of off on onto out outside over past per round through "
    "throughout till to toward towards under underneath unlike until unto up upon via with "
    "within without",
    "pron": "i me my mine myself you your yours yourself yourselves he him his himself she her "
    "hers herself it its itself we us our ours ourselves they them their theirs themselves "
    "who whom whose which what whoever whomever whatever whichever anybody anyone anything "
    "everybody everyone everything nobody none nothing somebody someone something oneself "
    "thou thee thy thine thyself ye",
    "aux": "be am is are was were been being have has had having do does did will would shall "
    "should may might must can could ought 'll 're 've 'd 'm",
    "cconj": "and or but nor",
    "sconj": "although as because if lest than that though unless whereas whether while whilst",
    "part": "not n't 's 't",
}
#: the closed-class word lists: category -> lower-case words (module docstring)
CLOSED_CLASSES = {cat: frozenset(words.split()) for cat, words in _LISTS.items()}
_WORD_CLASS = {w: cat for cat, words in CLOSED_CLASSES.items() for w in words}
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u02bc": "'", "`": "'"})


def _is_punct(text: str) -> bool:
    return all(unicodedata.category(ch)[0] in "PS" for ch in text)


def word_category(word: str) -> str:
    """The category of one word (rules and lists in the module docstring).

    Args:
        word: the word as it appears in the text (leading/trailing whitespace is ignored
            unless the word is only whitespace). Curly apostrophes count as ``'``.

    Returns:
        one of :data:`CATEGORIES` other than ``special``.
    """
    text = word.strip()
    if not text:
        return "newline" if ("\n" in word or "\r" in word) else "space"
    if _is_punct(text):
        return "punct"
    lower = text.lower().translate(_APOSTROPHES)
    if any(ch.isdigit() for ch in text) or lower in NUMBER_WORDS:
        return "number"
    cat = _WORD_CLASS.get(lower)
    if cat is not None:
        return cat
    return "capitalised" if text[0].isupper() else "other"


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The text each token adds to the decoded sequence, leading whitespace included.

    A token's text is what decoding it after its predecessor appends (so tokenizers that
    mark word starts, such as SentencePiece's ``▁`` or word-level decoders that join with
    spaces, show the space); the first token is decoded alone.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        ids: token ids of one sequence.

    Returns:
        one string per token.
    """
    ids = [int(i) for i in ids]
    out: list[str] = []
    single: dict[int, str] = {}
    for i, tok in enumerate(ids):
        alone = single.setdefault(tok, tokenizer.decode([tok]))
        if i == 0:
            out.append(alone)
            continue
        prev = single.setdefault(ids[i - 1], tokenizer.decode([ids[i - 1]]))
        pair = tokenizer.decode([ids[i - 1], tok])
        out.append(pair[len(prev) :] if pair.startswith(prev) else alone)
    return out


def _continues(prev: str, text: str) -> bool:
    return bool(prev) and bool(text) and prev[-1].isalnum() and text[0].isalnum()


def token_categories(
    texts: Sequence[str], special: Sequence[bool] | None = None
) -> tuple[list[str], list[bool]]:
    """The category of every token's word, and whether the token continues a word.

    Args:
        texts: the tokens' texts in order (:func:`token_texts`), one sequence.
        special: per token, whether it is a special token (category ``special``, never part
            of a word); default none is.

    Returns:
        ``(categories, continuation)``: per token a name of :data:`CATEGORIES` and a bool.

    Raises:
        ValueError: ``special`` has another length than ``texts``.
    """
    n = len(texts)
    special = [False] * n if special is None else list(special)
    if len(special) != n:
        raise ValueError(f"special: expected {n} flags (one per token), got {len(special)}")
    cont = [
        i > 0 and not special[i] and not special[i - 1] and _continues(texts[i - 1], texts[i])
        for i in range(n)
    ]
    cats = ["special"] * n
    start = 0
    for i in range(n + 1):
        if i == n or not cont[i]:
            if start < i and not special[start]:
                cat = word_category("".join(texts[start:i]))
                cats[start:i] = [cat] * (i - start)
            start = i
    return cats, cont
