"""`fsutil.read_regular`: a file's bytes, whole, without following a link or blocking on a FIFO."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatcher import fsutil


def test_an_order_is_read_at_a_glance_beneath_the_open_inbox_only_if_it_is_a_regular_file(tmp_path: Path) -> None:
    """With `dir_fd`: the bytes of a file up to the limit; a larger file, a link or a FIFO are refused."""
    (tmp_path / "a.json").write_bytes(b"x" * 10)
    (tmp_path / "big.json").write_bytes(b"x" * 11)
    (tmp_path / "link.json").symlink_to(tmp_path / "a.json")
    os.mkfifo(tmp_path / "fifo.json")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert fsutil.read_regular("a.json", 10, dir_fd=fd) == b"x" * 10
        assert fsutil.read_regular("a.json", dir_fd=fd) == b"x" * 10
        with pytest.raises(ValueError, match="larger than 10 bytes"):
            fsutil.read_regular("big.json", 10, dir_fd=fd)
        with pytest.raises(fsutil.NotRegular):
            fsutil.read_regular("link.json", 10, dir_fd=fd)
        with pytest.raises(fsutil.NotRegular):
            fsutil.read_regular("fifo.json", 10, dir_fd=fd)  # opened without blocking, never read
        with pytest.raises(FileNotFoundError):
            fsutil.read_regular("gone.json", 10, dir_fd=fd)
    finally:
        os.close(fd)


def test_a_file_is_read_whole_whatever_its_size_or_what_fstat_said(tmp_path: Path) -> None:
    """Beyond the 1 MiB read size, and a file larger than its stat size (as one that grows after the fstat)."""
    big = bytes(range(256)) * (3 * 4096 + 7)
    (tmp_path / "big").write_bytes(big)
    assert fsutil.read_regular(str(tmp_path / "big")) == big
    assert fsutil.read_regular(tmp_path / "big", len(big)) == big
    with pytest.raises(ValueError, match="larger than"):
        fsutil.read_regular(tmp_path / "big", len(big) - 1)
    status = fsutil.read_regular("/proc/self/status")  # a regular file whose stat size is 0
    assert os.stat("/proc/self/status").st_size == 0
    assert status.startswith(b"Name:") and b"\nPid:" in status and status.endswith(b"\n")
    assert fsutil.read_regular(str(tmp_path / "big"), base=str(tmp_path)) == big
    (tmp_path / "empty").write_bytes(b"")
    assert fsutil.read_regular(tmp_path / "empty") == b""


def test_open_beneath_under_a_folder_opened_already_keeps_it_open_and_refuses_links(tmp_path: Path) -> None:
    """open_beneath(..., dir_fd=) opens rel under dir_fd, leaves dir_fd open, and refuses a link at any step."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_text("x")
    (tmp_path / "ln").symlink_to(tmp_path / "sub")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for rel in ("sub/f", "./sub//f"):
            fd = fsutil.open_beneath(tmp_path, rel, dir_fd)
            assert os.read(fd, 10) == b"x"
            os.close(fd)
        with pytest.raises(fsutil.NotRegular):
            fsutil.open_beneath(tmp_path, "ln/f", dir_fd)
        with pytest.raises(FileNotFoundError):
            fsutil.open_beneath(tmp_path, "sub/none", dir_fd)
        fd = fsutil.open_beneath(tmp_path, ".", dir_fd)  # no part: a new fd on the folder itself
        assert fd != dir_fd
        os.close(fd)
        os.fstat(dir_fd)  # still open
    finally:
        os.close(dir_fd)
