"""Prompt data: local datasets as `Record`s, the seeded epoch stream over them, and prompt formatting."""

from twinplane.data.formatting import PromptFormatter, filter_by_length
from twinplane.data.records import DataError, Record, load_records
from twinplane.data.stream import PromptStream

__all__ = ["DataError", "PromptFormatter", "PromptStream", "Record", "filter_by_length", "load_records"]
