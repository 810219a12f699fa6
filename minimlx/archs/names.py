"""Checkpoint tensor names <-> the names of minimlx's modules.

`NameMap` holds `(theirs, ours)` name prefixes, where `{i}` stands for a layer number. The same
table reads a checkpoint (theirs -> ours) and writes one (ours -> theirs); in both directions the
first matching pair wins, so more specific prefixes come first, and where several checkpoint
layouts name a tensor differently, the first pair gives the name written.
"""

import re

import mlx.core as mx


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)"))


class NameMap:
    def __init__(self, pairs: list[tuple[str, str]], drop: list[str] = ()):
        self.templates, self.drop_patterns = list(pairs), list(drop)
        self.pairs = [(_pattern(theirs), theirs, _pattern(ours), ours) for theirs, ours in pairs]
        self.drop = [re.compile(d) for d in drop]

    def extended(self, pairs: list[tuple[str, str]], drop: list[str] = ()) -> "NameMap":
        """This map with `pairs` tried first (a family's own names before those it shares)."""
        return NameMap(pairs + self.templates, [*drop, *self.drop_patterns])

    @staticmethod
    def _swap(name: str, pattern: re.Pattern, template: str) -> str | None:
        match = pattern.match(name)
        if match is None:
            return None
        return template.replace("{i}", match.groupdict().get("i") or "") + name[match.end() :]

    def to_ours(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint names -> model names; names in `drop` are skipped, names no pair matches kept as they are
        (the loader then reports them as unexpected)."""
        out = {}
        for name, value in weights.items():
            if any(d.search(name) for d in self.drop):
                continue
            renamed = (self._swap(name, theirs, ours) for theirs, _, _, ours in self.pairs)
            out[next((n for n in renamed if n is not None), name)] = value
        return out

    def to_theirs(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Model names -> checkpoint names (the first pair's layout)."""
        out = {}
        for name, value in weights.items():
            renamed = (self._swap(name, ours, theirs) for _, theirs, ours, _ in self.pairs)
            out[next((n for n in renamed if n is not None), name)] = value
        return out
