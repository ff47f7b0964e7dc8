"""The suite's own scheduling (tests/conftest.py): the files it hands out first still exist."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FIRST

ROOT = Path(__file__).resolve().parent.parent


def test_every_file_listed_to_run_first_exists_so_a_rename_does_not_drop_it_to_the_tail():
    assert [path for path in LONGEST_FIRST if not (ROOT / path).is_file()] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
