"""Reading a profile's YAML strictly: a repeated key, a number YAML 1.1 would read as text, or
nesting no profile has are errors that say where, not a silent last-wins or a RecursionError.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from ringflow.errors import ProfileError

#: deeper than any profile (the deepest field is two levels down)
MAX_DEPTH = 32
#: YAML 1.2 floats without a dot (1e30, -2E-3): PyYAML's 1.1 resolver reads them as strings
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    """SafeLoader refusing duplicate keys and deep nesting, reading 1e30 as a float."""

    def compose_node(self, parent, index):
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ProfileError(None, f"nests deeper than {MAX_DEPTH} levels at line "
                                   f"{mark.line + 1}; no profile field is more than two levels "
                                   f"down", self.source)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ProfileError(None, f"repeats key {key!r} (line {seen[key]} and line "
                                   f"{line}); YAML keeps only the last, so say it once",
                                   self.source)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def load(text: str, source: str | None) -> Any:
    """The document in ``text``.

    Raises:
        ProfileError: not valid YAML (with the line), a repeated key, or nesting deeper than
            :data:`MAX_DEPTH`.
    """
    loader = None
    try:
        loader = _Loader(text)  # reads the text's characters already
        loader.source = source
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or \
            type(exc).__name__
        raise ProfileError(None, f"is not valid YAML: {problem}{where}", source) from exc
    finally:
        if loader is not None:
            loader.dispose()
