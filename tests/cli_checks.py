"""Checks the CLI tests share."""


def one_line_error(code, err, *needles):
    """A user error: exit code 2, one line on stderr (no traceback) holding every needle."""
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
