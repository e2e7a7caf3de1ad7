"""Code problems from local files: each row becomes a prompt plus an answer that holds its unit tests, in the
JSON form the `code` reward reads (see `twinplane.rewards.code`).

Recognised rows (field names as the public datasets write them):
- HumanEval: `prompt`, `test`, `entry_point` -> {"prompt", "test", "entry_point"};
- MBPP: `text` (or `prompt`), `test_list`, optional `test_setup_code` -> {"test_list", "test_setup_code"};
- stdin/stdout: `inputs`, `outputs` lists, or APPS' `input_output` JSON text -> {"inputs", "outputs"};
- or an answer field that already holds one of these forms (an object, or its JSON).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from twinplane.data.records import Record, load_records
from twinplane.rewards.code import parse_tests

PROMPT_FIELDS = ("prompt", "text", "question", "problem")  # tried in order when no prompt field is named


def code_answer(row: dict, answer_field: str = "answer") -> str:
    """The row's tests as the code reward's JSON answer; ValueError when the row has no usable tests."""
    if "test" in row and "entry_point" in row:
        spec = {"prompt": row.get("prompt") or "", "test": row["test"], "entry_point": row["entry_point"]}
    elif "test_list" in row:
        tests = row["test_list"]
        spec = {"test_list": list(tests) if isinstance(tests, (list, tuple)) else tests,
                "test_setup_code": row.get("test_setup_code") or ""}
    elif "inputs" in row and "outputs" in row:
        spec = {"inputs": row["inputs"], "outputs": row["outputs"]}
    elif isinstance(row.get("input_output"), str):
        try:
            io = json.loads(row["input_output"])
        except json.JSONDecodeError as e:
            raise ValueError(f"field 'input_output' is not JSON ({e.msg})") from None
        spec = {"inputs": io.get("inputs"), "outputs": io.get("outputs")} if isinstance(io, dict) else io
    elif answer_field in row:
        spec = row[answer_field]
    else:
        raise ValueError(f"no tests: expected fields test+entry_point, test_list, inputs+outputs, input_output or "
                         f"{answer_field!r} (fields: {', '.join(map(str, row))})")
    parse_tests(spec)  # the reward's own check, now rather than at the first rollout
    return spec if isinstance(spec, str) else json.dumps(spec)


def load_code_records(path: str | Path, prompt_field: str | None = None, answer_field: str = "answer",
                      system_field: str | None = None, on_error: str = "fail") -> tuple[list[Record], dict]:
    """`load_records` for code problems: prompts from `prompt_field` (default: the first of PROMPT_FIELDS the
    data has), answers from `code_answer`."""
    fields: str | Sequence[str] = prompt_field or PROMPT_FIELDS
    return load_records(path, fields, answer_field, system_field, on_error=on_error,
                        answer_fn=lambda row: code_answer(row, answer_field))
