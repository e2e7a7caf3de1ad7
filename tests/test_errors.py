"""`first_line`: an exception's message as one line of an error message of ours, the one helper every layer uses."""

import pytest

from twinplane.errors import first_line


@pytest.mark.parametrize(("e", "plain", "typed"), [
    (ValueError("bad value"), "bad value", "ValueError: bad value"),
    (ValueError("\n  the first line\nthe second\n"), "the first line", "ValueError: the first line"),
    (KeyError("k"), "'k'", "KeyError: 'k'"),
    (RuntimeError(), "RuntimeError", "RuntimeError"),  # no message: the type name, once
    (RuntimeError(" \n "), "RuntimeError", "RuntimeError"),
    (OSError("x" * 500), "x" * 200, "OSError: " + "x" * 200),
])
def test_first_line(e, plain, typed):
    assert first_line(e) == plain
    assert first_line(e, typed=True) == typed
