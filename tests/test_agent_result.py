"""The agent-result parser: the JSON object that ends an agent's stdout, found in linear time.

`parse_agent_result` is pure. The cases copied from test_runner_unit.py pin down what
counts as an agent_result (contract section 5); the ones after them feed it the stdout
a hostile or merely chatty agent can print, and bound the time it may take.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from dispatcher.job.agent_result import AGENT_RESULT_KEYS, AGENT_RESULT_MAX, parse_agent_result, with_cut_start

RESULT = {"type": "result", "is_error": False, "total_cost_usd": 0.01, "session_id": "s-1", "usage": {"in": 3}}


@pytest.mark.parametrize(
    "stdout",
    [
        json.dumps(RESULT),
        "working...\nstill working\n" + json.dumps(RESULT) + "\n",
        "log line\n" + json.dumps(RESULT, indent=2) + "\n\n  \n",
        "log line\r\n" + json.dumps(RESULT) + "\r\n",
        "   " + json.dumps(RESULT) + "   ",
        "\xff\xfe not utf-8 \n" + json.dumps(RESULT),
        '{"half": \n' + json.dumps(RESULT, indent=4),
        "{" + ",\n ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in RESULT.items()) + "}\n",
        "log line\n{" + ",\n   ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in RESULT.items()) + "}\n\n  \n",
    ],
    ids=[
        "alone",
        "after-text",
        "pretty",
        "crlf",
        "indented",
        "bad-bytes-before",
        "broken-object-before",
        "opened-at-column-0-rest-indented",
        "opened-at-column-0-after-text",
    ],
)
def test_final_object_is_taken_whole(stdout: str) -> None:
    """When the last non-blank text is one JSON object, on one line or many, it is returned whole."""
    assert parse_agent_result(stdout.encode("latin-1" if "\xff" in stdout else "utf-8")) == RESULT


def test_object_with_nested_lines_starting_with_a_brace() -> None:
    """A pretty-printed object whose inner lines start with `{` is still taken whole, not its last part."""
    value = {"result": [{"a": 1}, {"b": {"c": [{"d": 2}]}}], "usage": {"x": 1}}
    assert parse_agent_result(("text\n" + json.dumps(value, indent=2)).encode()) == value


def test_deep_nesting_is_kept() -> None:
    """A moderately deep object (40 levels) is returned as it is."""
    value: dict[str, Any] = {"leaf": True}
    for _ in range(40):
        value = {"x": value}
    assert parse_agent_result(json.dumps(value).encode()) == value


def test_pathologically_deep_nesting_does_not_raise() -> None:
    """An object nested 200 000 levels deep yields no agent_result instead of crashing the attempt."""
    text = '{"x":' * 200_000 + "1" + "}" * 200_000
    assert parse_agent_result(text.encode()) is None


@pytest.mark.parametrize(
    "stdout",
    [
        "",
        "   \n\n",
        "all done\n",
        json.dumps(RESULT) + "\nall done\n",
        json.dumps([RESULT]),
        json.dumps([RESULT], indent=2),
        '"a string"',
        "42",
        "null",
        "result: " + json.dumps(RESULT),
        json.dumps(RESULT) + " " + json.dumps(RESULT),
        '{"a": 1',
        '{"a": 1}}',
        "{not json}",
    ],
    ids=[
        "empty",
        "blank",
        "text",
        "text-after",
        "list",
        "pretty-list",
        "string",
        "number",
        "null",
        "prefixed",
        "two-objects",
        "unclosed",
        "extra-brace",
        "not-json",
    ],
)
def test_no_result_unless_stdout_ends_with_one_object(stdout: str) -> None:
    """Text after the object, a list, a scalar or anything not one whole object gives no agent_result."""
    assert parse_agent_result(stdout.encode()) is None


SUMMARY_KEYS = {"total_cost_usd", "session_id", "num_turns", "is_error", "duration_ms", "usage"}


def big_result(filler: str, n: int) -> dict[str, Any]:
    return {
        "type": "result",
        "result": filler * n,
        "total_cost_usd": 0.5,
        "session_id": "s-9",
        "num_turns": 7,
        "is_error": False,
        "duration_ms": 1234,
        "usage": {"input_tokens": 10, "output_tokens": 20},
        "permission_denials": [],
    }


def test_large_object_keeps_only_the_named_keys() -> None:
    """An object over 64 KiB keeps only total_cost_usd, session_id, num_turns, is_error, duration_ms, usage."""
    value = big_result("x", 70_000)
    got = parse_agent_result(("log\n" + json.dumps(value)).encode())
    assert got == {k: value[k] for k in SUMMARY_KEYS}


def test_large_object_does_not_invent_missing_keys() -> None:
    """Cut down, an object keeps only the named keys it had."""
    got = parse_agent_result(json.dumps({"result": "x" * 70_000, "is_error": True}).encode())
    assert got == {"is_error": True}


def test_object_under_64_kib_is_whole() -> None:
    """An object just under 64 KiB is kept whole, with every key."""
    value = big_result("x", 1)
    value["result"] = "x" * (64 * 1024 - len(json.dumps(value)) - 10)
    assert parse_agent_result(json.dumps(value).encode()) == value


def test_large_pretty_object_with_many_inner_objects_keeps_the_named_keys() -> None:
    """A pretty-printed final object holding thousands of objects (one per line) is still found and cut down."""
    value = {"is_error": False, "session_id": "s-2", "messages": [{"i": i} for i in range(2500)]}
    got = parse_agent_result(("log\n" + json.dumps(value, indent=2)).encode())
    assert got is not None, "the final object was not found"
    assert got == {"is_error": False, "session_id": "s-2"}


def test_size_limit_counts_bytes() -> None:
    """The 64 KiB limit is in bytes: 25 000 three-byte characters (75 kB) are over it."""
    value = big_result("€", 25_000)
    data = json.dumps(value, ensure_ascii=False).encode()
    assert len(data) > 64 * 1024
    got = parse_agent_result(data)
    assert got is not None
    assert sorted(got) == sorted(SUMMARY_KEYS), "an object over 64 KiB of UTF-8 was kept whole"


# -- hostile and chatty stdout ------------------------------------------------------------------


def timed(tail: bytes) -> tuple[dict[str, Any] | None, float]:
    """Return what the parser finds in tail and the seconds it took."""
    start = time.perf_counter()
    got = parse_agent_result(tail)
    return got, time.perf_counter() - start


def test_constants_are_the_contract_limits() -> None:
    """The size limit is 64 KiB and the kept keys are the six the contract names."""
    assert AGENT_RESULT_MAX == 64 * 1024
    assert set(AGENT_RESULT_KEYS) == SUMMARY_KEYS


def test_four_mib_of_open_brackets_is_rejected_fast() -> None:
    """4 MiB of lines like `{"a":[` ending in `}` gives no agent_result, in well under a second of CPU."""
    line = b'{"a":[\n'
    tail = line * (4 * 1024 * 1024 // len(line)) + b"}"
    got, seconds = timed(tail)
    assert got is None
    assert seconds < 2.0, f"took {seconds:.1f} s"


def test_many_brace_lines_before_a_real_result_still_find_it_fast() -> None:
    """A real result printed after 4 MiB of brace-led junk lines is still found, quickly."""
    line = b'{"a":[\n'
    tail = line * (4 * 1024 * 1024 // len(line)) + json.dumps(RESULT).encode() + b"\n"
    got, seconds = timed(tail)
    assert got == RESULT
    assert seconds < 2.0, f"took {seconds:.1f} s"


@pytest.mark.parametrize(
    "tail",
    [
        b'{"x":' * 800_000 + b"1" + b"}" * 800_000,
        b"{\n" + b"[" * 4_000_000 + b"\n}",
        b'{"x":[\n' * 300_000 + b"1" + b"]}" * 300_000,
    ],
    ids=["objects-on-one-line", "lists-inside-one-object", "one-level-per-line"],
)
def test_deep_nesting_attack_gives_none_fast(tail: bytes) -> None:
    """Millions of nesting levels give no agent_result, never a RecursionError, and take little time."""
    got, seconds = timed(tail)
    assert got is None
    assert seconds < 2.0, f"took {seconds:.1f} s"


def test_pretty_object_with_indented_inner_objects_is_taken_whole() -> None:
    """In a pretty-printed result, indented inner objects (hundreds of them) are parts, never the answer."""
    value = {"type": "result", "session_id": "s-3", "steps": [{"n": i, "meta": {"ok": True}} for i in range(300)]}
    text = "starting\n" + json.dumps(value, indent=2) + "\n"
    assert text.count("\n    {") >= 300
    got, seconds = timed(text.encode())
    assert got == value
    assert seconds < 2.0


@pytest.mark.parametrize("inner", [8, 12, 1000])
def test_an_object_whose_inner_objects_open_at_column_0_is_taken_whole(inner: int) -> None:
    """`json.dumps(indent=0)` opens every inner object at column 0 too: they are tried and passed over, however
    many, and the object that ends stdout is taken whole (its cost kept)."""
    value = {"total_cost_usd": 0.25, "session_id": "s1", "list": [{"x": i} for i in range(inner)]}
    text = "working\n" + json.dumps(value, indent=0) + "\n"
    assert text.count("\n{") == inner + 1
    got, seconds = timed(text.encode())
    assert got == value
    assert seconds < 2.0


def test_claude_style_result_after_lots_of_log_text_is_found() -> None:
    """One claude-style result line after 2 MB of log lines (some JSON, some starting with `{`) is taken."""
    claude = {
        "type": "result",
        "subtype": "success",
        "is_error": False,
        "duration_ms": 5120,
        "num_turns": 4,
        "result": "Assigned 3 requests.",
        "session_id": "0b7f9a52-3c1e-4a57-9d1e-2f6c1a1b9e11",
        "total_cost_usd": 0.0421,
        "usage": {"input_tokens": 1200, "output_tokens": 310},
    }
    log = []
    for i in range(40_000):
        log.append(f"[{i}] reading request R{i % 7}: nothing unusual")
        if i % 10 == 0:
            log.append(json.dumps({"type": "assistant", "n": i}))
        if i % 13 == 0:
            log.append("{ unbalanced brace in a log line")
    text = "\n".join(log) + "\n" + json.dumps(claude) + "\n"
    assert len(text) > 1_900_000
    got, seconds = timed(text.encode())
    assert got == claude
    assert seconds < 2.0


def test_log_line_led_by_a_brace_after_the_result_hides_it() -> None:
    """A line printed after the result, even one starting with `{`, means stdout does not end with it."""
    text = json.dumps(RESULT) + "\n{ not json }"
    assert parse_agent_result(text.encode()) is None


def test_a_number_beyond_a_float_and_the_non_json_constants_read_as_null() -> None:
    """1e400 is valid JSON but no float; NaN and Infinity are not JSON: each is null, never inf or nan."""
    assert parse_agent_result(b'{"total_cost_usd": 1e400, "n": -1e999, "ok": 0.5}') == {
        "total_cost_usd": None,
        "n": None,
        "ok": 0.5,
    }
    assert parse_agent_result(b'{"a": NaN, "b": Infinity, "c": -Infinity}') == {"a": None, "b": None, "c": None}


def test_a_lone_surrogate_is_recorded_as_the_replacement_character() -> None:
    """`"\\ud800"` in a string or key cannot be written as UTF-8: it becomes U+FFFD; a real pair stays one emoji."""
    out = b'{"s": "a\\ud800", "usage": {"n\\udc00te": ["\\ud83d\\ude00"]}, "total_cost_usd": 1.2}\n'
    value = parse_agent_result(out)
    assert value == {"s": "a\ufffd", "usage": {"n\ufffdte": ["\U0001f600"]}, "total_cost_usd": 1.2}
    json.dumps(value, ensure_ascii=False).encode("utf-8")  # writable: no UnicodeEncodeError


def test_a_final_object_longer_than_the_tail_kept_still_gives_its_cost_and_session() -> None:
    """A final JSON of 5 MB (a long `result`): only its last 4 MiB are kept, its start cut off, yet the keys kept
    of a large object are read where they stand; a key spelled inside a string is not one."""
    final = {
        "type": "result",
        "is_error": False,
        "result": "b" * 5_000_000 + ' and then "total_cost_usd": 99, "session_id": "no"',
        "session_id": "s-1",
        "total_cost_usd": 0.5,
        "usage": {"input_tokens": 3, "output_tokens": 4},
    }
    tail = json.dumps(final).encode()[-4 * 1024 * 1024 :]
    assert parse_agent_result(tail) == {
        "session_id": "s-1",
        "total_cost_usd": 0.5,
        "usage": {"input_tokens": 3, "output_tokens": 4},
    }
    assert parse_agent_result(b"x" * 70_000 + b"}") is None  # no key of a final JSON: nothing


def test_the_start_of_an_object_longer_than_the_tail_is_read_from_the_log_only_when_the_log_ends_with_it(
    tmp_path: Any,
) -> None:
    """The keys before the kept tail come from stdout.log's last line; a log that does not end with the tail (cut by
    max_log_bytes) or a last line that is no object gives nothing more; keys the tail holds win."""
    line = json.dumps(
        {"total_cost_usd": 0.5, "is_error": True, "pad": "x" * 5000, "total_cost_usd_": 1, "num_turns": 2}
    )
    log = tmp_path / "stdout.log"
    log.write_text("some progress\n" + line + "\n")
    tail = line.encode()[-1000:] + b"\n"
    tail_keys = {"num_turns": 2}  # what the tail alone gives (a real one is 4 MiB: its keys read where they stand)
    assert with_cut_start(tail, tail_keys, str(log), 1001) == {"total_cost_usd": 0.5, "is_error": True, "num_turns": 2}
    assert with_cut_start(tail, tail_keys, str(log), 5000) == tail_keys  # the tail held the whole line: as it was
    log.write_text("some progress\n" + line + "\n[cut: max_log_bytes]\n")
    assert with_cut_start(tail, tail_keys, str(log), 1001) == tail_keys
    log.write_text("x" * 6000 + line[5050:] + "\n")
    assert with_cut_start(tail, tail_keys, str(log), 1001) == tail_keys


def test_an_integer_too_long_to_convert_is_null_and_the_cost_is_kept() -> None:
    """A final object holding an integer of 5,000 digits (more than Python converts) keeps its cost, with that
    integer null, as for a float beyond range; it lost the whole object, and the attempt its cost."""
    big = "7" * 5000
    result = parse_agent_result(f'working\n{{"total_cost_usd": 0.5, "n": {big}, "m": 12}}\n'.encode())
    assert result == {"total_cost_usd": 0.5, "n": None, "m": 12}


def test_an_indent_0_object_after_a_line_ending_in_a_comma_with_many_inner_objects_is_found() -> None:
    """`json.dumps(..., indent=0)` after a line that ends in `,`: the object's own start looks like a list
    element, and its ten inner objects open at the same column; it is found by its brackets, read back from its
    end (it was lost, and the attempt's cost with it, beyond eight inner objects)."""
    body = {"type": "result", "total_cost_usd": 0.5, "note": 'a "quoted" {brace} \\ and [bracket]',
            "messages": [{"i": i} for i in range(10)]}  # fmt: skip
    out = "Reviewed files a.py, b.py,\n" + json.dumps(body, indent=0) + "\n"
    assert parse_agent_result(out.encode()) == body
    assert parse_agent_result(b"no object here, {\n]\n}") is None  # brackets that do not pair: nothing
