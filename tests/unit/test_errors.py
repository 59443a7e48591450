"""aitune.errors.one_line: the one helper that turns an exception into a line of a report or an error message."""

from aitune.errors import one_line


def test_one_line_keeps_the_first_meaningful_line_with_the_type_name():
    exc = ValueError("\n  first line  \n\nsecond line\n")
    assert one_line(exc) == "ValueError: first line"
    assert one_line(exc, type_name=False) == "first line"
    assert one_line(RuntimeError()) == "RuntimeError" == one_line(RuntimeError("  \n"), type_name=False)


def test_one_line_joins_several_lines_when_asked():
    """load_state_dict puts the useful part on the second line of its message."""
    exc = RuntimeError("Error(s) in loading state_dict for Wider:\n\tsize mismatch for proj.weight\n\tthird\n\tfourth")
    assert one_line(exc, lines=3) == ("RuntimeError: Error(s) in loading state_dict for Wider: "
                                      "size mismatch for proj.weight third")


def test_one_line_cuts_at_the_limit_with_an_ellipsis():
    text = one_line(ValueError("x" * 500), 200, type_name=False)
    assert len(text) == 200 and text == "x" * 199 + "…"
    assert one_line(ValueError("short"), 200, type_name=False) == "short"
