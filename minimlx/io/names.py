"""Renaming checkpoint tensors to the names of minimlx's modules."""

import re

import mlx.core as mx


def rename(weights: dict[str, mx.array], rules: list[tuple[str, str]], drop: list[str] = ()) -> dict[str, mx.array]:
    """Apply the first matching `(pattern, replacement)` regex rule to each name; skip names matching `drop`.

    Names that no rule matches pass through unchanged (the loader then reports them as unexpected).
    """
    dropped = [re.compile(d) for d in drop]
    compiled = [(re.compile(p), r) for p, r in rules]
    out = {}
    for name, value in weights.items():
        if any(d.search(name) for d in dropped):
            continue
        for pattern, replacement in compiled:
            if pattern.search(name):
                name = pattern.sub(replacement, name)
                break
        out[name] = value
    return out
