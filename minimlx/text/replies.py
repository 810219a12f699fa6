"""An assistant's generated text split into what clients read apart: content, reasoning and tool calls."""

from dataclasses import dataclass

from .tool_formats import tool_format


@dataclass
class Delta:
    """A piece of one reply, in the order the model wrote it.

    `kind` is "content" (answer text), "reasoning" (thinking text), "tool_call" (a call starts: `index` counts the
    reply's calls from 0, `id` and `name` are set) or "arguments" (`text` is a fragment of call `index`'s JSON
    arguments; the fragments of one call join to its whole arguments).
    """

    kind: str
    text: str = ""
    index: int = 0
    name: str | None = None
    id: str | None = None


class ReplyParser:
    """Splits a reply streaming in as text pieces into content, reasoning and tool-call deltas.

    Text is passed on as soon as it can no longer be the start of a marker; whitespace at either end of a stretch
    of content or reasoning is dropped (so none surrounds calls). A call is announced once its name is known and its
    arguments then stream as compact JSON text. The reply starts in reasoning when `prompt`, the rendered prompt,
    ends by opening it (`<think>`). With `reasoning` False, reasoning markers are plain content; with `tools` False,
    call markers are. A call still open at `close()` keeps what was written of it once its name was known; an
    opened run of calls that never named one is content, unless the calls were `forced` (a grammar made the reply a
    call: its cut start is no answer text, and is dropped).
    """

    def __init__(self, template: str | None, tools: bool, reasoning: bool, prompt: str, forced: bool = False):
        self.format = tool_format(template)
        self.tools, self.reasoning, self.forced = tools, reasoning, forced
        opened = [close for open, close in self.format.reasoning.items() if prompt.rstrip().endswith(open)]
        self.closing = opened[0] if opened and reasoning else None  # the marker ending the reasoning we are in
        self.buffer, self.held, self.fresh = "", "", True
        self.run: str | None = None  # the text of the run of calls being read, from its opening marker on
        self.run_marker, self.run_written = "", []  # its marker; how much of each of its calls' arguments is out
        self.call_count = 0

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        return self._advance(final=False)

    def close(self) -> list[Delta]:
        """The deltas of whatever text is still held, the reply being over."""
        return self._advance(final=True)

    def _markers(self) -> tuple[str, ...]:
        if self.closing:
            return (self.closing,)
        reasoning = tuple(self.format.reasoning) if self.reasoning else ()
        return reasoning + self.format.dropped + (self.format.opens if self.tools else ())

    def _advance(self, final: bool) -> list[Delta]:
        out = []
        while self.run is None or self._read_run(out, final):
            markers = self._markers()
            found = [(self.buffer.find(m), -len(m), m) for m in markers if m in self.buffer]
            if not found:
                held = marker_start(self.buffer, markers)
                if final and not (self.forced and self.tools):  # a forced call's cut marker is no answer text
                    held = 0
                self._write(out, self.buffer[: len(self.buffer) - held])
                self.buffer = self.buffer[len(self.buffer) - held :]
                if final:
                    self.held = ""
                return out
            start, _, marker = min(found)
            self._write(out, self.buffer[:start])
            self.buffer = self.buffer[start + len(marker) :]
            self.held, self.fresh = "", True
            if marker == self.closing:
                self.closing = None
            elif marker in self.format.reasoning:
                self.closing = self.format.reasoning[marker]
            elif marker in self.format.opens:
                self.run, self.run_marker, self.run_written = marker, marker, []
        return out

    def _write(self, out: list[Delta], text: str) -> None:
        """Text of the current stretch: its leading whitespace skipped, trailing whitespace held until more follows."""
        if self.fresh:
            text = text.lstrip()
            self.fresh = not text
        body = text.rstrip()
        if body:
            add(out, Delta("reasoning" if self.closing else "content", self.held + body))
            self.held = text[len(body) :]
        else:
            self.held += text

    def _read_run(self, out: list[Delta], final: bool) -> bool:
        """Read the run of calls further; True once it is over and the text after it is to be read."""
        self.run += self.buffer
        self.buffer = ""
        calls, end = self.format.calls(self.run)
        if not calls and final and self.forced:  # a forced call cut before its name: nothing to show
            self.run = None
            return True
        if not calls and (end is not None or final):  # no call after all: its marker is content
            self._write(out, self.run_marker)
            self.buffer, self.run = self.run[len(self.run_marker) :], None
            return True
        for k, (name, arguments) in enumerate(calls):
            index = self.call_count - len(self.run_written) + k
            if k == len(self.run_written):
                index = self.call_count
                out.append(Delta("tool_call", index=index, name=name, id=self.format.call_id()))
                self.run_written.append(0)
                self.call_count += 1
            if len(arguments) > self.run_written[k]:
                add(out, Delta("arguments", arguments[self.run_written[k] :], index=index))
                self.run_written[k] = len(arguments)
        if end is None and not final:
            return False
        self.buffer, self.run, self.fresh = self.run[end or len(self.run) :], None, True
        return True


def marker_start(text: str, markers: tuple[str, ...]) -> int:
    """How many of `text`'s last characters could be the start of one of `markers`."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


def add(out: list[Delta], delta: Delta) -> None:
    """Append `delta`, joined to the last one when it goes on with the same text."""
    if out and delta.kind != "tool_call" and (out[-1].kind, out[-1].index) == (delta.kind, delta.index):
        out[-1].text += delta.text
    else:
        out.append(delta)
