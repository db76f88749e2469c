"""A refusal takes the file it judged and no other (contract section 1: nothing is ever overwritten or deleted).

`refuse` links the judged file into a staging folder, makes it durable, then removes the
inbox name. A new drop renamed over that name meanwhile, or a second daemon refusing the
same file, met it between those steps: these tests put them there, in-process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from dispatcher import fsutil
from dispatcher.job.recovery import finish_staging
from dispatcher.layout import Layout
from dispatcher.lifecycle import State
from dispatcher.store import refusals
from dispatcher.store.refusals import Refusal, refuse


def _layout(tmp_path: Path) -> Layout:
    layout = Layout(tmp_path / "dispatch")
    for folder in (layout.inbox, layout.staging, layout.folder(State.FAILED)):
        folder.mkdir(parents=True, exist_ok=True)
    return layout


def _drop(layout: Layout, name: str, data: bytes) -> tuple[int, int]:
    """Rename a new file with data onto inbox/<name>, as a person's safe drop does; return its identity."""
    tmp = layout.inbox / f".{name}.tmp"
    tmp.write_bytes(data)
    os.rename(tmp, layout.inbox / name)
    st = os.lstat(layout.inbox / name)
    return st.st_dev, st.st_ino


def _refused(layout: Layout) -> dict[str, bytes]:
    """Return each refusal folder's name and the bytes of the file it keeps."""
    out = {}
    for folder in sorted(layout.folder(State.FAILED).iterdir()):
        kept = [p for p in folder.iterdir() if p.name != "result.json"]
        assert len(kept) == 1, list(folder.iterdir())
        out[folder.name] = kept[0].read_bytes()
        assert json.loads((folder / "result.json").read_text())["state"] == "failed"
    return out


def test_a_drop_renamed_over_the_judged_file_before_the_refusal_is_not_refused_in_its_place(tmp_path: Path) -> None:
    """Junk A is judged; a valid order B takes its name before the refusal links it: B is left in inbox/ (its own
    event judges it), not refused for A's reason, and no staging folder is left."""
    layout = _layout(tmp_path)
    judged = _drop(layout, "z.yaml", b"junkA: 1\n")
    _drop(layout, "z.yaml", b'{"job_id": "B-1"}\n')
    assert refuse(layout, Refusal("z.yaml", "not an order", inode=judged), "vm-1") is None
    assert (layout.inbox / "z.yaml").read_bytes() == b'{"job_id": "B-1"}\n'
    assert _refused(layout) == {}
    assert list(layout.staging.iterdir()) == []


def test_a_drop_renamed_over_the_name_while_the_refusal_is_made_durable_stays_in_inbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Junk A is linked into its refusal; B is renamed onto its name before that name is removed: A is refused with
    its bytes, and B stays in inbox/, whole (the daemon removed it before)."""
    layout = _layout(tmp_path)
    judged = _drop(layout, "z.yaml", b"junkA: 1\n")
    real = fsutil.fsync_many

    def with_a_drop(paths: Iterable[str | Path]) -> list[OSError | None]:
        _drop(layout, "z.yaml", b"orderB: 1\n")
        return real(paths)

    monkeypatch.setattr(fsutil, "fsync_many", with_a_drop)
    placed = refuse(layout, Refusal("z.yaml", "not an order", inode=judged), "vm-1")
    assert placed is not None
    assert list(_refused(layout).values()) == [b"junkA: 1\n"]
    assert (layout.inbox / "z.yaml").read_bytes() == b"orderB: 1\n"


def test_two_daemons_refusing_one_file_place_one_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Daemon X links the junk file; daemon Y refuses it whole meanwhile: X finds its name taken by Y and drops its
    own staging folder. One refusal, the bytes in it, no staging folder left (the next start placed it twice)."""
    layout = _layout(tmp_path)
    judged = _drop(layout, "n1.txt", b"x\n")
    real = fsutil.fsync_many
    other: list[Path | None] = []

    def the_other_daemon_first(paths: Iterable[str | Path]) -> list[OSError | None]:
        if not other:
            monkeypatch.setattr(fsutil, "fsync_many", real)
            other.append(refuse(layout, Refusal("n1.txt", "not an order", inode=judged), "vm-2"))
        return real(paths)

    monkeypatch.setattr(fsutil, "fsync_many", the_other_daemon_first)
    assert refuse(layout, Refusal("n1.txt", "not an order", inode=judged), "vm-1") is None
    assert other[0] is not None
    assert list(_refused(layout).items()) == [(other[0].name, b"x\n")]
    assert list(layout.staging.iterdir()) == []
    assert not (layout.inbox / "n1.txt").exists()


def test_a_name_removed_by_a_person_meanwhile_leaves_the_refusal_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The inbox name is removed by hand between the link and its removal: the refusal, the one copy left, is
    placed, not dropped."""
    layout = _layout(tmp_path)
    judged = _drop(layout, "gone.txt", b"keep me\n")
    real = fsutil.fsync_many

    def removed(paths: Iterable[str | Path]) -> list[OSError | None]:
        (layout.inbox / "gone.txt").unlink()
        return real(paths)

    monkeypatch.setattr(fsutil, "fsync_many", removed)
    assert refuse(layout, Refusal("gone.txt", "not an order", inode=judged), "vm-1") is not None
    assert list(_refused(layout).values()) == [b"keep me\n"]


class _Cut(Exception):
    """The daemon's death, between a refusal's durable folder and its inbox name's removal."""


def _cut_before_the_name_goes(layout: Layout, name: str, judged: tuple[int, int], owner: str) -> None:
    """Run a refusal that dies just before it removes the inbox name: its staging folder stays."""
    with pytest.MonkeyPatch.context() as mp:

        def dies(src: Path, kept: Path) -> bool:
            raise _Cut

        mp.setattr(refusals, "_take_name", dies)
        with pytest.raises(_Cut):
            refuse(layout, Refusal(name, "not a work order", job_id="J-9", inode=judged), owner)


def test_a_refusal_cut_before_its_name_went_is_placed_at_start_and_logged(tmp_path: Path) -> None:
    """The next start places the dead daemon's refusal, removes the inbox name, and logs the `job.refused` line the
    dead daemon never wrote (it logs as the folder lands)."""
    layout = _layout(tmp_path)
    judged = _drop(layout, "junk.txt", b"junk\n")
    _cut_before_the_name_goes(layout, "junk.txt", judged, "vm-dead")
    with capture_logs() as logs:
        finish_staging(layout, None, alive=lambda owner: False)  # type: ignore[arg-type]
    assert list(_refused(layout).values()) == [b"junk\n"]
    assert not (layout.inbox / "junk.txt").exists() and list(layout.staging.iterdir()) == []
    [line] = [e for e in logs if e["event"] == "job.refused"]
    assert (line["file"], line["job_id"], line["reason"]) == ("junk.txt", "J-9", "not a work order")
    assert line["folder"] == next(layout.folder(State.FAILED).iterdir()).name


def test_a_dead_daemons_refusal_of_a_file_another_daemon_refused_is_dropped(tmp_path: Path) -> None:
    """Daemon X died holding a refusal; daemon Y refused the same file whole meanwhile: the next start drops X's
    staging folder instead of placing the file a second time."""
    layout = _layout(tmp_path)
    judged = _drop(layout, "n2.txt", b"x\n")
    _cut_before_the_name_goes(layout, "n2.txt", judged, "vm-dead")
    assert refuse(layout, Refusal("n2.txt", "not a work order", inode=judged), "vm-live") is not None
    finish_staging(layout, None, alive=lambda owner: owner == "vm-live")  # type: ignore[arg-type]
    assert len(_refused(layout)) == 1
    assert list(layout.staging.iterdir()) == []
