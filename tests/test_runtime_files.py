"""runtime/files.py: a file replaced whole or not at all."""

from __future__ import annotations

import pytest

from megabatch.runtime.files import replace_whole


def test_a_file_is_replaced_whole_and_a_failed_write_leaves_the_old_one_and_no_partial(tmp_path):
    path = tmp_path / "made" / "kept.json"
    replace_whole(path, lambda partial: partial.write_text("old"))  # its folder made first
    assert path.read_text() == "old"

    def fails(partial):
        partial.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_whole(path, fails)
    assert path.read_text() == "old" and sorted(p.name for p in path.parent.iterdir()) == ["kept.json"]
