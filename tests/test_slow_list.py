"""The slow list (``tests/slow_tests.txt``) reads as its lines say, and stale names are found."""

from __future__ import annotations

import pytest

from tests.slow_list import LIST, read_slow_list, stale_names


def test_the_list_reads_and_names_test_files_that_exist() -> None:
    listed = read_slow_list(LIST.read_text())
    assert listed, "the list is empty"
    root = LIST.parent.parent
    missing = sorted({n.split("::")[0] for n in listed if not (root / n.split("::")[0]).is_file()})
    assert not missing, f"slow_tests.txt names files that do not exist: {missing}"


def test_ids_with_spaces_comments_and_bad_lines() -> None:
    text = "# a comment\n\ntests/a.py::t[x y-2]  3.1\ntests/a.py::u 4\n"
    assert read_slow_list(text) == {"tests/a.py::t[x y-2]": 3.1, "tests/a.py::u": 4.0}
    with pytest.raises(ValueError, match=r"slow_tests\.txt:1"):
        read_slow_list("tests/a.py::t\n")
    with pytest.raises(ValueError, match="listed twice"):
        read_slow_list("tests/a.py::t 1\ntests/a.py::t 2\n")


def test_a_renamed_test_is_stale_only_where_its_file_was_collected() -> None:
    listed = ["tests/a.py::gone", "tests/a.py::kept", "tests/b.py::other"]
    collected = ["tests/a.py::kept", "tests/a.py::new"]
    assert stale_names(listed, collected) == ["tests/a.py::gone"]
