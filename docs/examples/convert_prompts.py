"""Prompt files in the row schema megatron_rl reads (docs/data.md),
from JSONL, parquet and a datasets folder:

    python docs/examples/convert_prompts.py train.jsonl prompts.jsonl
    python docs/examples/convert_prompts.py train.parquet prompts.parquet
    python docs/examples/convert_prompts.py saved/ prompts.parquet

(saved/: a folder Dataset.save_to_disk wrote). Each source row here is
GSM8K's: {"question": ..., "answer": "<worked solution> #### 72"}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def gsm8k_row(row: dict) -> dict:
    """One source row -> {prompt, answer, data_source}: the answer is
    what follows GSM8K's '####'."""
    return {
        "prompt": row["question"],
        "answer": row["answer"].split("####")[-1].strip(),
        "data_source": "gsm8k",
    }


def convert_jsonl(src, dst, to_row=gsm8k_row) -> None:
    with open(src, encoding="utf-8") as rows, \
            open(dst, "w", encoding="utf-8") as out:
        for line in rows:
            if line.strip():
                out.write(json.dumps(to_row(json.loads(line))) + "\n")


def convert_parquet(src, dst, to_row=gsm8k_row) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [to_row(row) for row in pq.read_table(src).to_pylist()]
    pq.write_table(pa.Table.from_pylist(rows), dst)


def convert_datasets_folder(src, dst, to_row=gsm8k_row, split="train"):
    """A folder Dataset.save_to_disk wrote (a DatasetDict's: `split`
    picks one) -> parquet."""
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(str(src))
    if isinstance(dataset, DatasetDict):
        dataset = dataset[split]
    rows = dataset.map(to_row, remove_columns=dataset.column_names)
    rows.to_parquet(str(dst))


def main(src: str, dst: str) -> None:
    if Path(src).is_dir():
        convert_datasets_folder(src, dst)
    elif src.endswith(".parquet"):
        convert_parquet(src, dst)
    else:
        convert_jsonl(src, dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
