"""Which models stay loaded: a memory budget (serve's --max-memory) and idle times (--keep-alive, Ollama's per-request
`keep_alive`). Model-free, as decode/scheduler.py is: it sees names, bytes, requests in flight and clocks, and decides;
the holder of the models (models.py) loads and unloads as it says.

A model with requests in flight is never chosen to leave. When the budget is full of such models, a model that wants
in waits (`room_for` answers None) until their requests finish.
"""

import math
import re
from dataclasses import dataclass

from ..errors import InvalidSettingError

FOREVER = math.inf  # a keep-alive that never expires (Ollama's negative keep_alive; serve's default)


@dataclass
class Resident:
    """A loaded model as the policy sees it."""

    bytes: int
    last_used: float  # when it was loaded, or its last request finished
    keep_alive: float  # seconds it stays loaded once idle
    in_flight: int = 0  # requests holding it


class Residency:
    """The loaded models, and the policy of which leave: `budget` bytes at most (None: no bound), each idle model
    unloaded `keep_alive` seconds after its last request (unless a request set its own)."""

    def __init__(self, budget: int | None = None, keep_alive: float = FOREVER):
        self.budget, self.keep_alive = budget, keep_alive
        self.residents: dict[str, Resident] = {}

    def room_for(self, size: int) -> list[str] | None:
        """The models to unload, least recently used first, so that a model of `size` bytes fits the budget; None
        while that memory is held by models with requests in flight (wait for them). A model larger than the
        whole budget is let in once every other model has left."""
        if self.budget is None:
            return []
        over = sum(r.bytes for r in self.residents.values()) + size - self.budget
        idle = sorted((r.last_used, name) for name, r in self.residents.items() if not r.in_flight)
        leaving = []
        for _, name in idle:
            if over <= 0:
                break
            leaving.append(name)
            over -= self.residents[name].bytes
        if over > 0 and any(r.in_flight for r in self.residents.values()):
            return None
        return leaving

    def held_back(self, size: int) -> list[str]:
        """While `room_for(size)` waits: the models with requests in flight that must leave too, least recently used
        first. New requests for them wait as well, so that a steady stream of them cannot keep the newcomer out."""
        if self.budget is None:
            return []
        idle = sum(r.bytes for r in self.residents.values() if not r.in_flight)
        over = sum(r.bytes for r in self.residents.values()) + size - self.budget - idle
        leaving = []
        for _, name in sorted((r.last_used, name) for name, r in self.residents.items() if r.in_flight):
            if over <= 0:
                break
            leaving.append(name)
            over -= self.residents[name].bytes
        return leaving

    def loaded(self, name: str, size: int, now: float) -> None:
        self.residents[name] = Resident(size, now, self.keep_alive)

    def unloaded(self, name: str) -> None:
        del self.residents[name]

    def began(self, name: str, keep_alive: float | None = None) -> None:
        """A request now holds `name`; its `keep_alive` (seconds; None: the server's) is how long the model stays
        loaded once idle again, as Ollama's request field sets it."""
        resident = self.residents[name]
        resident.in_flight += 1
        if keep_alive is not None:
            resident.keep_alive = keep_alive

    def finished(self, name: str, now: float) -> None:
        resident = self.residents.get(name)
        if resident is not None:
            resident.in_flight -= 1
            resident.last_used = now

    def expires_at(self, name: str) -> float:
        """When `name` leaves if no request comes (inf: never, or not while requests hold it)."""
        resident = self.residents[name]
        return FOREVER if resident.in_flight else resident.last_used + resident.keep_alive

    def expired(self, now: float) -> list[str]:
        """The idle models whose keep-alive has passed."""
        return [name for name in self.residents if self.expires_at(name) <= now]

    def next_expiry(self) -> float:
        return min((self.expires_at(name) for name in self.residents), default=FOREVER)


DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
UNITS = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}
SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)", re.IGNORECASE)


def seconds(value, field: str) -> float:
    """A keep-alive as Ollama writes it: seconds (a number, or a string of one), or a Go duration ("5m", "1h30m",
    "300ms"); negative means forever."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return FOREVER if value < 0 else float(value)
    if isinstance(value, str):
        text = value.strip().lower()
        sign, text = (-1, text[1:]) if text.startswith("-") else (1, text)
        try:
            number = float(text)
        except ValueError:
            parts = DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise InvalidSettingError(
                    f"'{field}' is {value!r}; give seconds or a duration such as '5m', '30s', '1h' (negative: forever)",
                    field,
                ) from None
            number = sum(float(n) * UNITS[u] for n, u in parts)
        return FOREVER if sign < 0 else number
    raise InvalidSettingError(f"'{field}' must be seconds or a duration such as '5m', got {value!r}", field)


def byte_size(text: str) -> int:
    """A memory size as people write it: 8GB, 512MB, 1.5G, 4GiB, or plain bytes (powers of 1024 for each unit)."""
    found = SIZE.fullmatch(text.strip())
    if found is None:
        raise InvalidSettingError(f"{text!r} is not a memory size; write it as 8GB, 512MB or a number of bytes")
    number, unit = float(found.group(1)), found.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))
