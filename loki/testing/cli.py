"""Checks of the command line's user errors, shared by the command tests."""

from __future__ import annotations

__all__ = ["one_error_line"]


def one_error_line(capsys, *words: str, whole: bool = False) -> str:
    """The one ``error: ...`` line a command printed on stderr (read from pytest's ``capsys``), holding every one of
    ``words``, and no traceback; ``whole=True``: that line is all of stderr.  Returns the line."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    if whole:
        assert len(lines) == 1 and lines[0].startswith("error: "), err
    else:
        lines = [line for line in lines if line.startswith("error: ")]
        assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]
