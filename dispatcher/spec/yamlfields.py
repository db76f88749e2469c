"""Where in a YAML document a refused value stands: its field path, for an error that names the field.

Two pure helpers of the strict loader (``spec.loader``): one walks the parser's events,
one the composed node tree. Paths read as the contract's errors write them:
``items[0].id``; the top level is ``""`` (None from ``field_at``).
"""

from __future__ import annotations

from typing import Any

import yaml


def field_at(text: str, loader: Any, target: int) -> str | None:
    """Return the field path of the value the parser's event number ``target`` stands on (None: the top level).

    An event on a mapping's key names that mapping: the key itself is no field yet.
    """
    # one frame per open collection: [its path, index or key of the next value, True while a key is expected]
    frames: list[list[Any]] = []
    for n, event in enumerate(yaml.parse(text, Loader=loader)):
        if isinstance(event, (yaml.StreamStartEvent, yaml.StreamEndEvent, yaml.DocumentStartEvent)):
            continue
        if isinstance(event, yaml.DocumentEndEvent):
            frames.clear()
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            frames.pop()
            top = frames[-1] if frames else None
        else:
            top = frames[-1] if frames else None
            if top is None:
                path = ""
            elif isinstance(top[1], int):
                path = f"{top[0]}[{top[1]}]"
            elif top[2]:  # a key: what is wrong with it is the mapping's
                path = top[0]
            else:
                path = f"{top[0]}.{top[1]}" if top[0] else top[1]
            if n == target:
                return path or None
            if isinstance(event, yaml.CollectionStartEvent):
                key_of = isinstance(event, yaml.MappingStartEvent)
                frames.append([path, "" if key_of else 0, key_of])
                continue
        if top is None:
            continue
        if isinstance(top[1], int):  # the next item of a sequence
            top[1] += 1
        elif top[2]:  # a key read: its value comes next (a key that is not a plain string names no field)
            top[1] = event.value if isinstance(event, yaml.ScalarEvent) else "?"
            top[2] = False
        else:  # a value read: a key comes next
            top[2] = True
    return None


def path_of(root: yaml.Node, target: yaml.Node) -> str:
    """Return the field path of target in the tree under root ("" for root, or when target is a key)."""
    todo: list[tuple[yaml.Node, str]] = [(root, "")]
    while todo:
        node, path = todo.pop()
        if node is target:
            return path
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if key_node is target:
                    return path
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                todo.append((value_node, f"{path}.{key}" if path else key))
        elif isinstance(node, yaml.SequenceNode):
            todo.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))
    return ""
