"""Named activation capture for the one loop.

The loop and the blocks hand their intermediate arrays to a recorder when one is passed; with
none they run exactly the production graph. Names are `embed`, `layers.{i}.{what}`,
`final_norm` and `logits`.
"""

import mlx.core as mx


class Recorder:
    """Keeps the activations whose names are in `names` (all of them when `names` is None)."""

    def __init__(self, names: list[str] | None = None, prefix: str = "", values: dict | None = None):
        self.names = set(names) if names is not None else None
        self.prefix = prefix
        self.values: dict[str, mx.array] = {} if values is None else values

    def scope(self, prefix: str) -> "Recorder":
        """A view that records into the same store under `prefix` (e.g. `layers.3.`)."""
        view = Recorder(None, self.prefix + prefix, self.values)
        view.names = self.names
        return view

    def __call__(self, **activations: mx.array) -> None:
        for name, value in activations.items():
            full = self.prefix + name
            if self.names is None or full in self.names:
                self.values[full] = value
