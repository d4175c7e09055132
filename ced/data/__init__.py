"""ced.data: byte tokenizer, the task registry (synthetic tasks with their chance levels and
suite sweeps, shared with the evaluation suite) and the deterministic, resumable token sources
the trainer reads.

    tok = ByteTokenizer()                              # 259 ids: bytes, BOS, EOS, PAD
    ex = make_example("kv_recall", seed=3, distance=200, length=512)
    ex.prompt_ids, ex.answer_ids, ex.meta["distance"]
    source = build_source(DataConfig(kind="synthetic"), "train")
    batch = source.rows(start=0, count=8, seq_len=256)  # input_ids, labels, answer_mask, family_ids
"""

from .config import DataConfig
from .metrics import answer_accuracy
from .sources import SequenceSource, build_source
from .registry import Point, Sweep, Task, family_task, families, task, unregister
from .tasks import TASKS, Example, TaskParamError, chance_accuracy, filler_text, make_example
from .tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Example", "TASKS", "Task", "Sweep", "Point", "task", "unregister",
           "families", "family_task", "make_example", "chance_accuracy", "filler_text",
           "TaskParamError", "DataConfig", "build_source", "SequenceSource", "answer_accuracy"]
