"""The glance at a YAML order (priority, not_before, after, to, expires) is read by byte searches, same answers."""

from __future__ import annotations

import random

from dispatcher.spec import orders
from dispatcher.spec.orders import peek_schedule

KEYS = [
    (b"priority:", orders._TOP_PRIORITY),
    (b"not_before:", orders._TOP_NOT_BEFORE),
    (b"after:", orders._TOP_AFTER),
    (b"to:", orders._TOP_TO),
    (b"expires:", orders._TOP_EXPIRES),
]
LINES = [
    b"to: a",
    b"to: 'b c'",
    b" to: d",
    b"to: e # who",
    b"toto: z",
    b"to:f",
    b"priority: 7",
    b"priority: x",
    b"priority: 3  ",
    b"after: [A]",
    b"expires: 2026-01-01",
    b"not_before: '2026-01-01T00:00:00Z'",
    b"#c",
    b"",
    b"\r",
]


def test_the_byte_search_finds_what_a_regex_scan_of_the_whole_file_finds() -> None:
    """On 5,000 random documents (mixed line ends), each key's first matching top-level line is the same."""
    rnd = random.Random(15)
    docs = [b"", b"to: a", b"x: 1\nto: b\n", b"  to: x\nto: y"]
    for _ in range(5000):
        parts = [rnd.choice(LINES) for _ in range(rnd.randint(0, 7))]
        docs.append(rnd.choice([b"\n", b"\r\n", b"\n\n"]).join(parts))
    for doc in docs:
        for key, pattern in KEYS:
            want, got = pattern.search(doc), orders._top(doc, key, pattern)
            assert (want and (want.group(0), want.groups())) == (got and (got.group(0), got.groups())), (doc, key)


def test_a_large_yaml_order_is_glanced_at_whatever_follows_its_long_lists() -> None:
    """A 1 MB order whose `to:` and `priority:` come after a long nested list still gives them."""
    body = b"job_id: BIG\nmeta:\n  lines:\n" + b"    - one line of a long list\n" * 35000 + b"to: coder\npriority: 8\n"
    glance = peek_schedule(body, "BIG.yaml")
    assert (glance.agent, glance.priority, glance.joins) == ("coder", 8, False)


def test_a_json_order_is_glanced_at_as_its_validating_read_parses_it() -> None:
    """A byte-order mark, leading white space and every field the glance gives; anything else is the default."""
    body = b'{"job_id": "J", "to": "coder", "priority": 8, "after": ["P"], "not_before": "2030-01-01T00:00:00Z"}'
    for data in (body, b"\xef\xbb\xbf" + body, b" \r\n\t" + body):
        glance = peek_schedule(data, "J.json")
        assert (glance.agent, glance.priority, glance.joins) == ("coder", 8, True), data
        assert glance.not_before == 1893456000.0
    for data in (b"", b"[1, 2]", b"{", b"\xff\xfe{}", b'{"priority": 10, "to": 3}', b'{"priority": true}'):
        assert peek_schedule(data, "J.json") == orders.Glance(), data


def test_priority_is_seen_in_the_yaml_forms_an_order_may_be_written_in() -> None:
    """The glance that ranks inbox/ reads the priority the validated order holds (section 16: "higher is claimed
    first"): in JSON saved as .yaml of any size, after a byte-order mark, written `+9` or `!!int 9`."""
    import json

    big = json.dumps({"job_id": "BIG", "from": "a", "to": "w", "task": "t", "priority": 9,
                      "items": [{"id": f"R{i}", "pad": "x" * 100} for i in range(300)]}).encode()  # fmt: skip
    assert len(big) > orders.GLANCE_PARSE_MAX
    assert peek_schedule(big, "big.yaml").priority == 9
    assert peek_schedule(b"priority: +9\njob_id: A\n", "a.yaml").priority == 9
    assert peek_schedule(b"job_id: A\npriority: !!int 8\n", "a.yaml").priority == 8
    assert peek_schedule(b"\xef\xbb\xbfpriority: 7\njob_id: A\n", "a.yaml").priority == 7
    expires = peek_schedule(b'{"expires": "2030-01-01T00:00:00Z", "to": "w"}' + b" " * 20000, "x.yml")
    assert expires.expires is not None and expires.agent == "w"


def test_a_not_before_line_inside_a_quoted_scalar_is_never_taken_for_the_orders_own() -> None:
    """A double-quoted task that runs over a line starting `not_before: 2030...` holds no not_before key: the glance
    gives none (small order: parsed; large: left out, the order is read and its read decides), so the order is not
    put off until 2030. A real not_before after an apostrophe or quote is still seen (small: parsed)."""
    fooled = b'job_id: G1\nfrom: me\nto: echo\ntask: "run\nnot_before: 2030-01-01T00:00:00Z"\nitems: [{id: a}]\n'
    assert peek_schedule(fooled, "g1.yaml").not_before is None
    expiring = fooled.replace(b"not_before:", b"expires:")
    assert peek_schedule(expiring, "g1.yaml").expires is None
    pad = b"meta:\n  lines:\n" + b"    - one line of a long list\n" * 800
    assert len(pad) > orders.GLANCE_PARSE_MAX
    assert peek_schedule(fooled + pad, "g1.yaml").not_before is None
    real = b"job_id: G2\ntask: don't wait\nnot_before: 2030-01-01T00:00:00Z\nto: echo\n"
    assert peek_schedule(real, "g2.yaml").not_before == 1893456000.0
    assert peek_schedule(b"job_id: G3\nnot_before: 2030-01-01T00:00:00Z\n" + pad, "g3.yaml").not_before == 1893456000.0
    # a large order's expires after a quote is kept: it only brings the order's read forward (refused on time)
    quoted = b'job_id: G4\ntask: "a quoted task"\nexpires: 2030-01-01T00:00:00Z\n' + pad
    assert peek_schedule(quoted, "g4.yaml").expires == 1893456000.0


def test_a_to_priority_or_after_line_inside_a_quoted_scalar_is_never_taken_for_the_orders_own() -> None:
    """A double-quoted task that runs over a line `to: b"`, `priority: 9"` or `after: [X]"` holds none of those keys
    (a small order is parsed: the order's own values; a large one leaves such a `to` out, so the order is read)."""
    head = b'job_id: Q1\nfrom: me\ntask: "first part\n'
    small = peek_schedule(head + b'to: b"\nto: a\npriority: 1\nitems: [{id: R1}]\n', "q1.yaml")
    assert (small.agent, small.priority, small.joins) == ("a", 1, False)
    ranked = peek_schedule(head + b'priority: 9"\nto: a\npriority: 1\nitems: [{id: R1}]\n', "q1.yaml")
    assert (ranked.agent, ranked.priority) == ("a", 1)
    joined = peek_schedule(head + b'after: [X]"\nto: a\nitems: [{id: R1}]\n', "q1.yaml")
    assert (joined.agent, joined.joins) == ("a", False)
    pad = b"meta:\n  lines:\n" + b"    - one line of a long list\n" * 800
    large = peek_schedule(head + b'to: b"\nitems: [{id: R1}]\n' + pad + b"to: a\n", "q1.yaml")
    assert large.agent == ""  # unknown at a glance: the order is read, never left unread for b's gate
    plain = peek_schedule(b'job_id: Q2\ntask: "one line"\nto: a\npriority: 8\n' + pad, "q2.yaml")
    assert (plain.agent, plain.priority) == ("", 8)  # a quote before: left out, the read decides
