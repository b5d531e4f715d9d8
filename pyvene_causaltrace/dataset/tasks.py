"""Built-in tasks other than factual recall, run as known facts are (docs/datasets.md, "Other
tasks"): ``agreement``, ``retrieval`` and ``arithmetic`` (screened with ``known="none"``:
SmolLM2-135M-Instruct puts 4-43% on the sum but rarely ranks it first). User tasks are JSONL
files (:func:`~pyvene_causaltrace.dataset.records.read_records`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..arguments import checked
from ..errors import InputError
from .records import FactRecord
from .settings import DatasetSettings


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    records: tuple[FactRecord, ...]
    known: str = DatasetSettings.known  # the screen's default rule for this task


def _records(task: str, rows: list[tuple[str, str, str, int]]) -> tuple[FactRecord, ...]:
    return tuple(FactRecord(f"{task}-{i}", prompt, span, target, occurrence)
                 for i, (prompt, span, target, occurrence) in enumerate(rows))


_AGREEMENT = [
    ("The keys to the cabinet", "keys", " are", 0),
    ("The key to the cabinets", "key", " is", 0),
    ("The pictures on the wall", "pictures", " are", 0),
    ("The picture on the walls", "picture", " is", 0),
    ("The dogs near the house", "dogs", " are", 0),
    ("The dog near the houses", "dog", " is", 0),
    ("The students in the class", "students", " are", 0),
    ("The student in the classes", "student", " is", 0),
]
_RETRIEVAL = [
    ("Anna lives in Paris. Bob lives in Rome. Bob lives in", "Bob", " Rome", 1),
    ("Anna lives in Paris. Bob lives in Rome. Anna lives in", "Anna", " Paris", 1),
    ("Tom has a cat. Sue has a dog. Sue has a", "Sue", " dog", 1),
    ("Tom has a cat. Sue has a dog. Tom has a", "Tom", " cat", 1),
    ("Mia plays chess. Leo plays golf. Leo plays", "Leo", " golf", 1),
    ("Mia plays chess. Leo plays golf. Mia plays", "Mia", " chess", 1),
]
_FEW_SHOT = "1 + 1 + 1 = 3\n2 + 1 + 1 = 4\n"
_ARITHMETIC = [(_FEW_SHOT + f"{a} + {b} + {c} =", f"{a} + {b}", f" {a + b + c}", 0)
               for a, b, c in ((3, 2, 4), (2, 3, 1), (1, 4, 2), (4, 1, 3), (2, 2, 3), (1, 2, 2))]

TASKS: dict[str, Task] = {
    "agreement": Task("agreement", "subject-verb agreement across a distractor",
                      _records("agreement", _AGREEMENT)),
    "retrieval": Task("retrieval", "in-context key-value retrieval",
                      _records("retrieval", _RETRIEVAL)),
    "arithmetic": Task("arithmetic", "two-step sums, first step corrupted",
                       _records("arithmetic", _ARITHMETIC), known="none"),
}


@checked
def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise InputError(f"unknown task {name!r}; built-in tasks: {', '.join(TASKS)} "
                         "(or pass a JSONL file of {prompt, subject, attribute})") from None
