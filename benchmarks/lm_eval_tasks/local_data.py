"""The parity tasks' items, read from the JSON Lines files beside this module (nothing is downloaded).

The task YAMLs name these functions as `custom_dataset`, so the files are found from here and not
from the current directory. lm-eval passes the task's metadata as keyword arguments; they are not
needed.
"""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def read_split(file_name: str) -> dict[str, datasets.Dataset]:
    with open(HERE / file_name, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def last_word(**metadata) -> dict[str, datasets.Dataset]:
    return read_split("last_word.jsonl")


def facts_mc(**metadata) -> dict[str, datasets.Dataset]:
    return read_split("facts_mc.jsonl")
