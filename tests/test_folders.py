"""`vlm_catalog.folders`: an output folder checked before a run, made only once it starts."""

from __future__ import annotations

import errno
import os

import pytest

from vlm_catalog.folders import check_folder_can_be_made


def test_a_missing_folder_is_checked_without_being_made(tmp_path):
    folder = tmp_path / "a" / "b" / "c"
    check_folder_can_be_made(folder)
    assert not (tmp_path / "a").exists()
    check_folder_can_be_made(tmp_path)  # an existing folder: probed, the probe removed
    assert list(tmp_path.iterdir()) == []


def test_a_file_in_the_way_is_not_a_directory(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for folder in (a_file, a_file / "under" / "it"):
        with pytest.raises(OSError) as caught:
            check_folder_can_be_made(folder)
        assert caught.value.errno == errno.ENOTDIR and caught.value.filename == str(a_file)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    with pytest.raises(OSError):  # mkdir would fail on it too (the link's name is taken)
        check_folder_can_be_made(dangling / "x")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may create entries in any folder")
def test_a_folder_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(OSError) as caught:
        check_folder_can_be_made(locked / "new")
    assert caught.value.errno == errno.EACCES
