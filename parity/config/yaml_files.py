"""Config files: YAML read with the refusals a config file needs, and a run's config written back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from parity.config.fields import quoted
from parity.config.run import Config
from parity.errors import ParityError, one_line
from parity.files import read_text


class _Refused(yaml.YAMLError):
    """A config file YAML reads but parity will not; the message names the line."""


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader, with two refusals a config file needs.

    Aliases: an alias is the anchored node itself, not a copy, so nine nested aliases in a few
    hundred bytes stand for 9^9 values, which anything that walks the value (`str`, `repr`)
    expands in memory. Each alias is weighed, as it is read, by the values it stands for;
    past ALIAS_VALUES in all the file is refused. A field holds one value, so anchors in a
    config only ever repeat scalars or merge a few keys (`<<: *base`).

    Keys: YAML requires a mapping's keys to be unique, and PyYAML lets the last one win, so a
    field given twice would silently take its second value. The top mapping's names are
    compared as fields, `-` read as `_`, as `load_yaml` reads them."""

    ALIAS_VALUES = 10_000

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._values: dict[int, int] = {}   # id(node) -> the values it stands for, expanded
        self._aliased = 0
        self._root: Any = None

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None:   # else PyYAML names the undefined alias
                self._aliased += self._count(node, event)
                if self._aliased > self.ALIAS_VALUES:
                    raise _Refused(f"{_at(event)}: its aliases stand for more than "
                                   f"{self.ALIAS_VALUES} values in all, at alias "
                                   f"*{event.anchor}; a field holds one value")
        return super().compose_node(parent, index)

    def _count(self, node: Any, alias: Any) -> int:
        """The values `node` stands for with every alias in it expanded, counted on the graph
        (each node once), never expanded."""
        if id(node) in self._values:
            return self._values[id(node)]
        if node.end_mark is None:   # still being read: the alias is inside its own anchor
            raise _Refused(f"{_at(alias)}: alias *{alias.anchor} is inside the value it "
                           f"names, which never ends")
        if isinstance(node, yaml.ScalarNode):
            n = 1
        elif isinstance(node, yaml.SequenceNode):
            n = 1 + sum(self._count(x, alias) for x in node.value)
        else:
            n = 1 + sum(self._count(k, alias) + self._count(v, alias) for k, v in node.value)
        self._values[id(node)] = n
        return n

    def construct_document(self, node: Any) -> Any:
        self._root = node
        return super().construct_document(node)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            self._refuse_repeated_keys(node)
        return super().construct_mapping(node, deep=deep)

    def _refuse_repeated_keys(self, node: Any) -> None:
        top = node is self._root
        seen: dict[Any, tuple[str, int]] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue   # `<<: *base`: the keys written beside it are meant to win
            key = self.construct_object(key_node)
            name = key.replace("-", "_") if top and isinstance(key, str) else key
            try:
                first = seen.get(name)
            except TypeError:
                continue   # an unhashable key: PyYAML's own refusal names it
            line = key_node.start_mark.line + 1
            if first is not None:
                as_ = "" if first[0] == key else f" (as {quoted(first[0])} and {quoted(key)})"
                what = "field" if top else "key"
                raise _Refused(f": {what} {quoted(name)} is given twice{as_}, on lines "
                               f"{first[1]} and {line}; YAML would silently keep the last")
            seen[name] = (key, line)


def _at(event: Any) -> str:
    return f", line {event.start_mark.line + 1}, column {event.start_mark.column + 1}"


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's mapping of field: value, names with `-` read as `_`; anything else is
    one line naming the file (and the line, where YAML gives one). Read by `_ConfigLoader`:
    no alias expands past a small budget, no field is given twice."""
    p = Path(path)
    text = read_text(p, "config file")
    try:
        data = yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader subclass
    except _Refused as e:
        raise ParityError(f"config file {p}{e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or one_line(e)
        raise ParityError(f"config file {p} is not valid YAML{at}: {problem}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        # YAML's own constructors: a date that is no date, an integer too long to convert
        raise ParityError(f"config file {p} is not valid YAML: {one_line(e)}") from None
    if data is None:  # an empty file, or only comments
        return {}
    if not isinstance(data, dict):
        raise ParityError(f"config file {p} must hold a mapping of field: value, not a "
                          f"{type(data).__name__}")
    for k in data:
        if not isinstance(k, str):
            raise ParityError(f"config file {p}: field name {quoted(k)} is not text")
    return {k.replace("-", "_"): v for k, v in data.items()}


def dump_yaml(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
