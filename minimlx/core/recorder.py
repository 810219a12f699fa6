"""Named activation capture for the one loop.

The loop and the blocks hand their intermediate arrays to a recorder when one is passed; with
none they run exactly the production graph. Names are `embed`, `layers.{i}.{what}`,
`final_norm` and `logits`. Attention hands over its queries and keys, and computes its weights
(which the fused kernel never forms) only when the recorder `wants` them.
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

    def wants(self, name: str) -> bool:
        """Whether `name` (in this view's scope) is recorded: for values that cost work to form."""
        return self.names is None or self.prefix + name in self.names

    def __call__(self, **activations: mx.array) -> None:
        for name, value in activations.items():
            if self.wants(name):
                self.values[self.prefix + name] = value
