"""fsutil's JSON text: the very text and errors of ``json.dumps(value, ensure_ascii=False)``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dispatcher import fsutil

LOOP: list[Any] = []
LOOP.append(LOOP)

VALUES: list[Any] = [
    {"a": 1.1, "b": [1e300, float("inf"), -float("inf"), float("nan"), 0.1 + 0.2, -0.0, 10**30]},
    {"ü\u2028": "x\ud800y\udcff", 7: None, 2.5: True, None: False, True: "t"},
    [{"x": {"y": [1, "é", (1, 2)]}}, {}, []],
    "top\ud800",
    3,
    None,
]
BAD: list[Any] = [LOOP, {"a": object()}, {(1, 2): 1}, {"x": b"b"}, set()]


def _error(fn: Any, value: Any) -> tuple[type[BaseException], str]:
    with pytest.raises(Exception) as info:
        fn(value)
    return info.type, str(info.value)


@pytest.mark.parametrize("c_encoder", [True, False], ids=["c", "pure"])
def test_text_bytes_and_errors_are_json_dumps(monkeypatch: pytest.MonkeyPatch, c_encoder: bool) -> None:
    """json_text and dump_json give json.dumps' text (dump_json with a newline, as UTF-8) and its errors."""
    if not c_encoder:
        monkeypatch.setattr(fsutil, "_MAKE", None)
    for value in VALUES:
        text = json.dumps(value, ensure_ascii=False)
        assert fsutil.json_text(value) == text
        assert fsutil.dump_json(value) == (text + "\n").encode("utf-8", "backslashreplace")
    for value in BAD:
        want = _error(lambda v: json.dumps(v, ensure_ascii=False), value)
        assert _error(fsutil.json_text, value) == want
        assert _error(fsutil.dump_json, value) == want
    assert fsutil.dump_json([1]) == b"[1]\n"  # nothing kept from an error
