"""The settings of one generation: listed and checked here, once, for every caller.

`minimlx run`/`chat` options, `stream_generate`'s keyword arguments and the HTTP fields of `minimlx serve` all
become one `SamplingSettings`; what it refuses raises InvalidSettingError naming the value and what is allowed,
before any work is done.
"""

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields

from ..core.sampling import Sampler, make_sampler
from ..errors import InvalidSettingError

SEEDS = 2**64  # mx.random.key takes seeds in [0, 2**64)


def whole(value) -> bool:
    """An integer (Python's or NumPy's), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_whole(name: str, value, low: int, high: int | None = None) -> None:
    """Refuse `value` unless it is a whole number in [low, high]."""
    if not whole(value) or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f">= {low}"
        raise InvalidSettingError(f"{name} must be a whole number {span}, got {value!r}")


@dataclass(frozen=True)
class SamplingSettings:
    """How one sequence is generated.

    `max_tokens` bounds the answer (the model's context may end it sooner). `temperature` 0 is greedy; above it,
    `top_k`, `top_p` and `min_p` filter the distribution a token is drawn from (0, 1 and 0 keep every token), and
    `seed` makes the draws reproducible. `repetition_penalty` above 1 makes tokens of the prompt and the answer
    less likely. `stop` strings end the answer before them: one string, or several (kept as a tuple).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()

    def __post_init__(self):
        check_whole("max_tokens", self.max_tokens, 1)
        if self.seed is not None:
            check_whole("seed", self.seed, 0, SEEDS - 1)
        stops = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        if not isinstance(stops, Sequence) or not all(isinstance(s, str) and s for s in stops):
            raise InvalidSettingError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stops))
        reals = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        for name, value in reals.items():
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidSettingError(f"{name} must be a finite number, got {value!r}")
        if not whole(self.top_k):
            raise InvalidSettingError(f"top_k must be a whole number, got {self.top_k!r}")
        problems = [
            (self.temperature < 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (not 0 < self.top_p <= 1, f"top_p must be in (0, 1] (1 keeps every token), got {self.top_p}"),
            (self.top_k < 0, f"top_k must be >= 0 (0 keeps every token), got {self.top_k}"),
            (not 0 <= self.min_p <= 1, f"min_p must be in [0, 1] (0 keeps every token), got {self.min_p}"),
            (
                self.repetition_penalty <= 0,
                f"repetition_penalty must be > 0 (1 is no penalty), got {self.repetition_penalty}",
            ),
        ]
        for bad, message in problems:
            if bad:
                raise InvalidSettingError(message)

    @property
    def greedy(self) -> bool:
        """Whether each token is the logits' argmax alone (no penalty, no draw)."""
        return self.temperature == 0 and self.repetition_penalty == 1.0

    def sampler(self) -> Sampler:
        return make_sampler(self.temperature, self.top_p, self.top_k, self.min_p)


NAMES = frozenset(f.name for f in fields(SamplingSettings))


def sampling_settings(settings: SamplingSettings | None, keywords: dict) -> SamplingSettings:
    """The settings a caller gave: a `SamplingSettings`, or its fields as keyword arguments
    (`stream_generate(..., max_tokens=32, temperature=0.7)`), not both."""
    if settings is None:
        return SamplingSettings(**keywords)
    if keywords:
        raise InvalidSettingError(f"give settings= or the settings {', '.join(sorted(keywords))} by name, not both")
    return settings
