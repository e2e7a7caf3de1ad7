"""Prompt datasets from local files: JSON Lines, Parquet, or a folder written by `datasets.Dataset.save_to_disk`.

Every row becomes a `Record` (prompt, reference answer, optional system prompt, metadata). The defaults match
GSM8K's original format (`question`, `answer` ending in `#### N`), so GSM8K loads with no options.

Problems are found before training starts and reported as one-line `DataError`s. They come in two kinds:
- problems with the file or the options (missing file, not UTF-8, an unknown field name, no records at all)
  always fail, because skipping them would silently train on nothing or on the wrong column;
- problems with one row (invalid JSON, not an object, a missing or mistyped value) fail with `file:line`
  under `on_error="fail"` (the default), or are skipped and counted under `on_error="skip"`.
Whether a field name is unknown is judged on the schema (Parquet, `datasets`) or the first well-formed row
(JSON): a field absent there is an option error. Later, a row without the prompt or answer is a row error; a
row without the system or a metadata field reads it as None.
Invalid UTF-8 always fails: it almost always means the whole file is in another encoding.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twinplane.errors import InputError, first_line

JSON_SUFFIXES = (".jsonl", ".json")


class DataError(InputError):
    """Bad prompt data or data options; the message is one line and names the file (and line) at fault."""


class _RowError(Exception):
    """One malformed row; `load_records` turns it into a `DataError` or a skip, depending on `on_error`."""


@dataclass(frozen=True)
class Record:
    prompt: str | list[dict]  # the question, or a chat as [{"role": ..., "content": ...}, ...]
    answer: str  # reference answer for the verifier (GSM8K: the full solution ending in "#### N")
    system: str | None = None  # per-record system prompt; overrides the formatter's configured one
    meta: dict = field(default_factory=dict)  # the requested `meta_fields`, passed through untouched


def _short(value: Any, limit: int = 60) -> str:
    """A one-line, bounded repr for error messages."""
    text = repr(value).replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# ---- row sources: each yields (location, row dict) and raises _RowError for a malformed row ----------------


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict | _RowError]]:
    """JSON Lines (optionally gzipped), read as bytes so that a line number can be given for invalid UTF-8; blank
    lines are ignored."""
    lineno = 0
    try:
        with (gzip.open(path, "rb") if path.suffix.lower() == ".gz" else path.open("rb")) as f:
            for lineno, raw in enumerate(f, 1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{where}: invalid UTF-8 at byte {e.start} (the file must be UTF-8)") from None
                if lineno == 1:
                    line = line.removeprefix("\ufeff")  # tolerate a byte-order mark
                if not line.strip():
                    continue
                try:
                    row = json.loads(line.rstrip("\r\n"))  # keep error columns on this line
                except json.JSONDecodeError as e:
                    yield where, _RowError(f"invalid JSON ({e.msg} at column {e.colno})")
                    continue
                yield where, row if isinstance(row, dict) else _RowError(f"expected a JSON object, got {_kind(row)}")
    except (OSError, EOFError, zlib.error) as e:  # not gzip, or cut short (a partial download)
        raise DataError(f"{path}: unreadable after line {lineno} ({first_line(e)})") from None


def _json_array_rows(path: Path) -> Iterator[tuple[str, dict | _RowError]]:
    """A `.json` file holding one array of objects (a common export format); rows are located by index."""
    try:
        rows = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: invalid UTF-8 at byte {e.start} (the file must be UTF-8)") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected JSON Lines or a JSON array of objects, got a JSON {_kind(rows)}")
    for i, row in enumerate(rows):
        yield f"{path}: item {i}", row if isinstance(row, dict) else _RowError(
            f"expected a JSON object, got {_kind(row)}")


def _rows_of_json(path: Path) -> Iterator[tuple[str, dict | _RowError]]:
    """`.json` may be JSON Lines or one array; peek at the first non-blank byte to tell which."""
    if path.suffix.lower() == ".json":
        with path.open("rb") as f:
            head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        if head.startswith(b"["):
            return _json_array_rows(path)
    return _jsonl_rows(path)


def _parquet_rows(path: Path) -> tuple[list[str], Iterator[tuple[str, dict]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt or non-Parquet file
        raise DataError(f"{path}: not a readable Parquet file ({first_line(e)})") from None

    def rows() -> Iterator[tuple[str, dict]]:
        n = 0
        try:
            for batch in pf.iter_batches(batch_size=4096):
                for row in batch.to_pylist():
                    n += 1
                    yield f"{path}: row {n}", row
        except Exception as e:  # a corrupt row group: pyarrow raises OSError or ArrowInvalid
            raise DataError(f"{path}: not a readable Parquet file after row {n} ({first_line(e)})") from None

    return list(pf.schema_arrow.names), rows()


def _saved_dataset_rows(path: Path, split: str | None) -> tuple[list[str], Iterator[tuple[str, dict]]]:
    """A `save_to_disk` folder: a `Dataset` (state.json) or, with `split`, one split of a `DatasetDict`."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
        except (ValueError, AttributeError) as e:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
            raise DataError(f"{path / 'dataset_dict.json'}: not a datasets split list ({first_line(e)})") from None
        if split is None:
            raise DataError(f"{path}: a DatasetDict folder with splits {', '.join(splits)}; "
                            f"pass split=<name> or point at the split's folder, e.g. {path / splits[0]}"
                            if splits else f"{path}: an empty DatasetDict folder")
        if split not in splits:
            raise DataError(f"{path}: no split {split!r} (splits: {', '.join(splits)})")
        path = path / split
    elif split is not None and (path / split / "state.json").is_file():
        path = path / split
    if not (path / "state.json").is_file():
        raise DataError(f"{path}: a folder, but not one written by datasets' save_to_disk (no state.json)")
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading a saved datasets folder needs `pip install datasets`") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # a damaged folder: datasets raises FileNotFoundError, ValueError, pyarrow errors...
        raise DataError(f"{path}: not a loadable saved dataset ({first_line(e)})") from None

    def rows() -> Iterator[tuple[str, dict]]:
        for i, row in enumerate(ds):
            yield f"{path}: row {i + 1}", row

    return list(ds.column_names), rows()


# ---- rows -> records ---------------------------------------------------------------------------------------


def _messages(value: list) -> list[dict]:
    if not value:
        raise _RowError("the prompt is an empty message list")
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise _RowError(f"a chat prompt must be a list of {{role, content}} string messages, got {_short(m)}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _to_record(row: dict, prompt_field: str, answer_field: str, system_field: str | None,
               meta_fields: Sequence[str], answer_fn: Callable[[dict], str] | None = None) -> Record:
    for name in (prompt_field, *([] if answer_fn else [answer_field])):
        if name not in row:
            raise _RowError(f"missing field {name!r} (fields: {', '.join(map(str, row))})")
    prompt = row[prompt_field]
    if answer_fn is not None:
        try:
            answer = answer_fn(row)
        except ValueError as e:
            raise _RowError(str(e)) from None
    else:
        answer = row[answer_field]
    if isinstance(prompt, list):
        prompt = _messages(prompt)
    elif not isinstance(prompt, str):
        raise _RowError(f"field {prompt_field!r} must be a string or a message list, got {_kind(prompt)}")
    elif not prompt.strip():
        raise _RowError(f"field {prompt_field!r} is empty")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)  # numeric answers (e.g. 72) are compared as text by the verifiers
    elif not isinstance(answer, str):
        raise _RowError(f"field {answer_field!r} must be a string or a number, got {_kind(answer)}")
    system = row.get(system_field) if system_field else None
    if system is not None and not isinstance(system, str):
        raise _RowError(f"field {system_field!r} must be a string, got {_kind(system)}")
    return Record(prompt, answer, system or None, {k: row.get(k) for k in meta_fields})


def _check_fields(where: str, available: Sequence[str], wanted: Sequence[str]) -> None:
    missing = [w for w in wanted if w not in available]
    if missing:
        names = ", ".join(repr(m) for m in missing)
        raise DataError(f"{where}: no field {names} (fields: {', '.join(map(str, available))})")


def load_records(path: str | Path, prompt_field: str | Sequence[str] = "question", answer_field: str = "answer",
                 system_field: str | None = None, meta_fields: Sequence[str] = (), on_error: str = "fail",
                 split: str | None = None, answer_fn: Callable[[dict], str] | None = None
                 ) -> tuple[list[Record], dict]:
    """Load every row of a local prompt file as a `Record`.

    The format follows the path: `.jsonl`/`.json` (JSON Lines; a `.json` file holding one array of objects also
    works), `.parquet`, or a folder written by `datasets` `save_to_disk` (`split` picks one split of a saved
    `DatasetDict`). Returns the records and stats: `loaded`, `skipped` (malformed rows skipped under
    `on_error="skip"`) and `skipped_examples` (the first few reasons, to print).
    prompt_field: a name, or candidate names: the first one the schema (or first row) has is used.
    answer_fn: builds the answer from the whole row instead of reading `answer_field` (code tasks: the tests);
    a ValueError it raises is a row error.
    """
    if on_error not in ("fail", "skip"):
        raise DataError(f"on_error must be 'fail' or 'skip', got {on_error!r}")
    if isinstance(meta_fields, str):
        meta_fields = (meta_fields,)
    path = Path(path)
    candidates = [prompt_field] if isinstance(prompt_field, str) else list(prompt_field)
    prompt_field = candidates[0]
    rest = [*([] if answer_fn else [answer_field]), *([system_field] if system_field else []), *meta_fields]
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.is_dir():
        columns, rows = _saved_dataset_rows(path, split)
    elif path.suffix.lower() == ".parquet":
        columns, rows = _parquet_rows(path)
    elif path.suffix.lower() in JSON_SUFFIXES or "".join(path.suffixes[-2:]).lower() == ".jsonl.gz":
        columns, rows = None, _rows_of_json(path)
    else:
        raise DataError(f"{path}: unknown data format {path.suffix!r} (use .jsonl, .jsonl.gz, .json, .parquet or a "
                        "folder written by datasets' save_to_disk)")
    if columns is not None:
        prompt_field = next((c for c in candidates if c in columns), prompt_field)
        _check_fields(str(path), columns, [prompt_field, *rest])

    records: list[Record] = []
    skipped: list[str] = []
    for where, row in rows:
        try:
            if isinstance(row, _RowError):
                raise row
            if columns is None:  # JSON: the first well-formed object stands in for the schema
                prompt_field = next((c for c in candidates if c in row), prompt_field)
                _check_fields(where, list(row), [prompt_field, *rest])
                columns = list(row)
            records.append(_to_record(row, prompt_field, answer_field, system_field, meta_fields, answer_fn))
        except _RowError as e:
            if on_error == "fail":
                raise DataError(f"{where}: {e} (on_error=skip skips such rows)") from None
            skipped.append(f"{where}: {e}")
    if not records:
        detail = f"all {len(skipped)} rows were malformed, e.g. {skipped[0]}" if skipped else "the dataset is empty"
        raise DataError(f"{path}: no records ({detail})")
    return records, {"loaded": len(records), "skipped": len(skipped), "skipped_examples": skipped[:3]}

