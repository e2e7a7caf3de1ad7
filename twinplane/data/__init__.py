"""Prompt data: local datasets as `Record`s (code problems with their tests too), the seeded epoch stream over
them, and prompt formatting."""

from twinplane.data.code_tasks import code_answer, load_code_records
from twinplane.data.formatting import PromptFormatter, filter_by_length
from twinplane.data.records import DataError, Record, load_records
from twinplane.data.stream import PromptStream

__all__ = ["DataError", "PromptFormatter", "PromptStream", "Record", "code_answer", "filter_by_length",
           "load_code_records", "load_records"]
