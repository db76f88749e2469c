"""Reading accept.output streamed: the same verdicts as reading it whole, in bounded memory.

`evidence.read_output` reads the file in chunks into an OutputSummary. Small files are
checked against summarising the records parsed whole (with chunks shrunk to a few
characters, so that every boundary is crossed); big ones are read by a fresh Python
process through `evidence.gather` and `run_checks`, the daemon's own path, with its
peak memory measured.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from dispatcher.checks import stream as output_stream
from dispatcher.checks.evidence import read_output
from dispatcher.checks.summary import summarise
from dispatcher.spec.orders import Order, validate_order

HERE = Path(__file__).resolve().parent
MB = 1_000_000


def make_order(output: str, n: int = 3, **accept: Any) -> Order:
    """Return an order with items R1..Rn whose accept.output is output."""
    body = {
        "job_id": "J-1",
        "from": "tester",
        "to": "worker",
        "task": "Assign each request to one team.",
        "items": [{"id": f"R{i}"} for i in range(1, n + 1)],
        "accept": {"output": output, **accept},
    }
    return validate_order(body)


def whole(data: bytes, rel: str) -> list[dict[str, Any]] | None:
    """Parse an output the simple way (all at once); None when it is unusable."""
    try:
        text = data.decode("utf-8-sig")
        if rel.endswith(".csv"):
            records: Any = list(csv.DictReader(io.StringIO(text, newline="")))
        elif rel.endswith(".jsonl"):
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            records = json.loads(text)
    except (ValueError, csv.Error):
        return None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        return None
    return records


def random_value(rnd: random.Random, depth: int = 0) -> Any:
    """Return a JSON value of the kinds agents write, ids and non-ids alike."""
    if depth > 2 or rnd.random() < 0.4:
        return rnd.choice(["R1", "R2", "R3", "R9", "orders", "", None, 1, 1.5, True, "caf\u00e9", "a,b", 'q"q', "x\ny"])
    if rnd.random() < 0.5:
        return [random_value(rnd, depth + 1) for _ in range(rnd.randint(0, 3))]
    return {rnd.choice(["id", "team"]): random_value(rnd, depth + 1) for _ in range(rnd.randint(0, 2))}


def random_file(rnd: random.Random, fmt: str) -> bytes:
    """Return a small output file of random records, now and then with one byte inserted."""
    records = [
        {k: random_value(rnd) for k in rnd.sample(["id", "team", "x"], rnd.randint(0, 3))}
        for _ in range(rnd.randint(0, 6))
    ]
    if fmt == "json":
        data = json.dumps(records, indent=rnd.choice([None, 1]), ensure_ascii=rnd.random() < 0.5).encode()
    elif fmt == "jsonl":
        data = "".join(json.dumps(r) + rnd.choice(["\n", "\r\n", "\n\n"]) for r in records).encode()
    else:
        buf = io.StringIO(newline="")
        writer = csv.writer(buf)
        writer.writerow(["id", "team", "x"][: rnd.randint(0, 3)])
        for r in records:
            writer.writerow(["" if v is None else str(v) for v in list(r.values())[: rnd.randint(0, 4)]])
        data = buf.getvalue().encode()
    if data and rnd.random() < 0.25:
        i = rnd.randrange(len(data) + 1)
        data = data[:i] + rnd.choice([b",", b"]", b"x", b" ", b"\n", b'"', b"{", b"\xff"]) + data[i:]
    return data


@pytest.mark.parametrize("chunk", [1, 3, 64 * 1024], ids=["chunk-1", "chunk-3", "chunk-64k"])
def test_streamed_summary_equals_reading_the_file_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """For 600 random small outputs, streaming gives the very summary (or refusal) that reading whole gives."""
    monkeypatch.setattr(output_stream, "CHUNK", chunk)
    rnd = random.Random(chunk)
    for trial in range(600):
        fmt = ("csv", "json", "jsonl")[trial % 3]
        rel = f"out.{fmt}"
        data = random_file(rnd, fmt)
        (tmp_path / rel).write_bytes(data)
        order = make_order(rel, allowed={"team": ["orders", ""]}, required=["team"])
        got = read_output(tmp_path, rel, order)
        records = whole(data, rel)
        if records is None:
            assert got.error is not None, (data, got)
        else:
            assert got.error is None, (data, got.error)
            assert got.value == summarise(order, records), data


@pytest.mark.parametrize(
    ("rel", "data", "error"),
    [
        ("o.json", b"", "cannot be parsed (Expecting value: line 1 column 1 (char 0))"),
        ("o.json", b'{"id": "R1"}', "is not a JSON list of objects"),
        ("o.json", b'[{"id": "R1"}, 7]', "holds a record that is not an object"),
        (
            "o.json",
            b'[{"id": "R1"},\n {"id": "R2"},]',
            "cannot be parsed (Expecting value: line 2 column 15 (char 29))",
        ),
        ("o.json", b'[{"id": "R1"} {"id": "R2"}]', "cannot be parsed (Expecting ',' delimiter"),
        ("o.json", b'[{"id": "R1"}] []', "cannot be parsed (Extra data: line 1 column 16 (char 15))"),
        ("o.json", b'[{"id": "R1"}', "cannot be parsed (Expecting ',' delimiter"),
        ("o.json", b"[" * 100_000 + b"]" * 100_000, "cannot be parsed (maximum recursion depth"),
        ("o.json", b'[{"id": "R1"}, {"id": "' + b"x" * (2 * 1024 * 1024) + b'"}]', "record 2 is larger than 1 MiB"),
        ("o.jsonl", b'{"id": "R1"}\n\n{"id": ' + b"1" * (2 * 1024 * 1024) + b"}\n", "record 2 is larger than 1 MiB"),
        ("o.jsonl", b'{"id": "R1"}\nnot json\n', "cannot be parsed (line 2: Expecting value, column 1)"),
        ("o.jsonl", b'{"id": "R1"}\n["R2"]\n', "holds a record that is not an object"),
        ("o.csv", b"id,team\nR1," + b"x" * (2 * 1024 * 1024) + b"\n", "record 1 is larger than 1 MiB"),
        ("o.csv", b"id,team\nR1,a\n" + b'"a\n",' * 400_000 + b"x\n", "record 2 is larger than 1 MiB"),
        ("o.csv", b"id" + b",x" * (1024 * 1024) + b"\nR1\n", "the header row is larger than 1 MiB"),
        ("o.csv", b"id\n\xff\xfe\n", "cannot be parsed ('utf-8' codec can't decode byte 0xff"),
        (
            "o.json",
            b'[{"id": "R1", "n": ' + b"9" * 5000 + b"}]",
            "cannot be parsed (a number has more than 4300 digits",
        ),
        ("o.jsonl", b'{"id": "R1", "n": ' + b"9" * 5000 + b"}\n", "cannot be parsed (line 1: a number has more than"),
    ],
    ids=[
        "json-empty",
        "json-object",
        "json-scalar-record",
        "json-trailing-comma",
        "json-no-comma",
        "json-extra-data",
        "json-unclosed",
        "json-deep",
        "json-huge-record",
        "jsonl-huge-record",
        "jsonl-bad-line",
        "jsonl-list-record",
        "csv-huge-field-row",
        "csv-many-quoted-lines",
        "csv-huge-header",
        "csv-not-utf8",
        "json-int-too-long",
        "jsonl-int-too-long",
    ],
)
def test_unusable_output_says_why(tmp_path: Path, rel: str, data: bytes, error: str) -> None:
    """A broken output, or one record larger than 1 MiB, is an error naming the cause, not a crash or a hog."""
    (tmp_path / rel).write_bytes(data)
    got = read_output(tmp_path, rel, make_order(rel))
    assert got.error is not None and got.error.startswith(error), got.error


@pytest.mark.parametrize("size", [131_073, 500_000, 1_040_000])
def test_a_csv_record_under_1_mib_is_read_whatever_its_one_field(tmp_path: Path, size: int) -> None:
    """A record may be up to 1 MiB (README limits), in one CSV field too: the csv module's own 128 KiB bound on a
    field does not refuse it."""
    (tmp_path / "o.csv").write_bytes(b"id,team\nR1," + b"x" * size + b"\n")
    got = read_output(tmp_path, "o.csv", make_order("o.csv", n=1))
    assert got.error is None, got.error


def test_file_that_grows_past_the_limit_while_read_is_refused(tmp_path: Path) -> None:
    """The size limit holds even when the file is larger than it said when opened."""
    (tmp_path / "o.jsonl").write_bytes(b'{"id": "R1"}\n' * 1000)
    fd = os.open(tmp_path / "o.jsonl", os.O_RDONLY)
    got = output_stream.summarise_fd(fd, "jsonl", make_order("o.jsonl"), 4096)
    assert got.error == "larger than 4096 bytes"
    with pytest.raises(OSError):
        os.fstat(fd)  # the fd was closed by summarise_fd


def test_fifo_output_is_refused_without_blocking(tmp_path: Path) -> None:
    """An agent that leaves a FIFO as its output gets an error; the reader never waits on it."""
    os.mkfifo(tmp_path / "out.csv")
    got = read_output(tmp_path, "out.csv", make_order("out.csv"))
    assert got.error == "is a FIFO, not a regular file"


# -- 40 MB outputs, read by the daemon's own code in a fresh process --------------------------

MEASURE = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    from dispatcher.checks.builtin import run_checks
    from dispatcher.checks.facts import Exit
    from dispatcher.checks.evidence import gather
    from dispatcher.spec.orders import validate_order

    work, rel = Path(sys.argv[1]), sys.argv[2]
    order = validate_order(json.loads((work / "order.json").read_text()))

    def check():
        ev, _ = gather(order=order, agent="worker", writes=(rel,), exit=Exit(code=0, seconds=1.0), work=work,
                       given={}, agents={"worker"}, max_timeout_s=60, max_order_bytes=1 << 20,
                       known=lambda ids: frozenset(), hops=0, max_hops=5)
        return run_checks(ev)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = check()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({"grown_kib": grown, "checks": {r.name: [r.ok, r.detail] for r in results}}))
    """
)


def measure(work: Path, rel: str, order: Order) -> tuple[int, dict[str, list[Any]]]:
    """Check work/ in a fresh process; return the growth of its peak RSS in KiB, and the checks."""
    (work / "order.json").write_text(json.dumps(dict(order.body)))
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(work), rel], capture_output=True, text=True, env=env, timeout=170
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    return out["grown_kib"], out["checks"]


def write_receipt(work: Path, output_ids: list[str]) -> None:
    """Write a receipt for J-1 with items R1..R3 and these output ids."""
    receipt = {"job_id": "J-1", "input_ids": ["R1", "R2", "R3"], "output_ids": output_ids, "status": "done"}
    (work / "receipt.json").write_text(json.dumps(receipt))


def test_forty_mb_csv_of_tiny_rows_is_checked_in_bounded_memory(tmp_path: Path) -> None:
    """A 40 MB CSV of ~4 million tiny rows is checked with under 64 MB of extra memory, and the verdicts are right."""
    with (tmp_path / "out.csv").open("w") as f:
        f.write("id,team\nR1,orders\nR2,orders\nR3,orders\n")
        i = 0
        while f.tell() < 40 * MB:
            f.write("".join(f"X{j},orders\n" for j in range(i, i + 10_000)))
            i += 10_000
        f.write("R2,bakery\n")
    write_receipt(tmp_path, ["R1", "R2", "R3"])
    order = make_order("out.csv", allowed={"team": ["orders"]})
    grown_kib, checks = measure(tmp_path, "out.csv", order)
    assert grown_kib < 64 * 1024, f"peak memory grew by {grown_kib // 1024} MB"
    ok, detail = checks["output_rows"]
    assert ok is False
    assert detail.startswith("out.csv id: extra X0, X1")
    assert f"{i - 1000} more records with other ids" in detail
    assert detail.endswith("; repeated R2")
    assert checks["receipt_outputs"][0] is False
    assert "missing X0" in checks["receipt_outputs"][1]
    assert checks["allowed_values"] == [False, 'record R2: team "bakery" is not allowed']
    assert checks["receipt_inputs"][0] is True


def test_forty_mb_json_list_is_checked_in_bounded_memory(tmp_path: Path) -> None:
    """A 40 MB JSON list is parsed element by element with under 64 MB of extra memory; counts are right."""
    n = 0
    with (tmp_path / "out.json").open("w") as f:
        f.write("[\n")
        while f.tell() < 40 * MB:
            f.write("".join(json.dumps({"id": f"R{1 + k % 3}", "team": "orders"}) + ",\n" for k in range(9_999)))
            n += 9_999
        f.write('{"id": null, "team": "orders"}\n]\n')
    write_receipt(tmp_path, ["R1", "R2", "R3"])
    grown_kib, checks = measure(tmp_path, "out.json", make_order("out.json", required=["team"]))
    assert grown_kib < 64 * 1024, f"peak memory grew by {grown_kib // 1024} MB"
    assert checks["output_rows"] == [False, "out.json id: repeated R1, R2, R3; none in 1 record"]
    assert checks["receipt_outputs"][0] is False
    assert checks["allowed_values"] == [True, f"{n + 1} records use allowed values"]


def test_forty_mb_json_list_of_the_item_ids_passes(tmp_path: Path) -> None:
    """A big output that is exactly one record per item (100 items, fat records) passes every output check."""
    items = [f"R{i}" for i in range(1, 101)]
    pad = "p" * 390_000  # 100 records of ~400 kB: 40 MB, each under the 1 MiB record limit
    with (tmp_path / "out.json").open("w") as f:
        f.write("[" + ",".join(json.dumps({"id": i, "team": "orders", "notes": pad}) for i in items) + "]")
    receipt = {"job_id": "J-1", "input_ids": items, "output_ids": items[::-1], "status": "done"}
    (tmp_path / "receipt.json").write_text(json.dumps(receipt))
    grown_kib, checks = measure(tmp_path, "out.json", make_order("out.json", n=100, required=["notes"]))
    assert grown_kib < 64 * 1024, f"peak memory grew by {grown_kib // 1024} MB"
    assert checks["output_rows"] == [True, "100 records, one per item"]
    assert checks["receipt_outputs"] == [True, "100 output ids match out.json"]
    assert checks["allowed_values"] == [True, "100 records use allowed values"]
