"""What a failure means to the caller: the exit codes of every `twinplane` command.

    0   done
    2   the user's input is wrong (config, data, model folder, checkpoint, reward function, CLI): an `InputError`.
        Retrying cannot help, so `supervise` and `--max-restarts` never do.
    75  preempted (SIGTERM/SIGINT): the state is saved and `--resume auto` continues (EX_TEMPFAIL).
    130 interrupted outside training (Ctrl-C in `eval`, `export`, ...): nothing to resume.
    1   a bug in twinplane (or a crashed worker): the traceback is printed, with a line saying which.
"""

from __future__ import annotations

EXIT_OK, EXIT_BUG, EXIT_INPUT, EXIT_PREEMPTED, EXIT_INTERRUPTED = 0, 1, 2, 75, 130


class InputError(ValueError):
    """Bad input from the user; the message is one line that names the file, key or argument at fault."""


def first_line(e: BaseException, typed: bool = False) -> str:
    """An exception's message as one line of an error message of ours: its first non-blank line, at most 200
    characters (a message without one: the exception's type name). `typed`: after the type name (`KeyError: 'x'`)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    return f"{type(e).__name__}: {lines[0][:200]}" if typed else lines[0][:200]


class Preempted(Exception):
    """A SIGTERM/SIGINT was handled: whatever could be saved is saved, and `--resume auto` continues."""
