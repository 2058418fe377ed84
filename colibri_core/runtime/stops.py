"""Stop strings over streamed text: the one cutter (a generation's Decode job runs it on
the scheduler's thread, for the Python API and the server alike)."""
from __future__ import annotations

import functools


class StopCutter:
    """Stop strings over streamed text: text that may be the start of a stop string is
    held back until it is known not to be one, so the client never sees any part of
    the stop string (which may straddle tokens). Each stop string is matched by a
    Knuth-Morris-Pratt automaton fed each new character once: time linear in the text,
    whatever the stop strings' length (params.py bounds their number and length)."""

    def __init__(self, stops: list):
        self.stops = stops
        self.tables = [_kmp_table(x) for x in stops]
        self.states = [0] * len(stops)   # per stop: the longest suffix of text that is its prefix
        self.text = ""            # everything the tokens decoded to
        self.sent = 0             # characters of it passed on

    def push(self, piece: str) -> tuple[str, bool]:
        base = len(self.text)
        self.text += piece
        if not self.stops:
            self.sent = len(self.text)
            return piece, False
        hits = []
        for n, (stop, table) in enumerate(zip(self.stops, self.tables)):
            k = self.states[n]
            for i, ch in enumerate(piece):
                while k and ch != stop[k]:
                    k = table[k - 1]
                if ch == stop[k]:
                    k += 1
                    if k == len(stop):         # its first occurrence: where it starts
                        hits.append(base + i + 1 - k)
                        break
            self.states[n] = k
        if hits:
            end = min(hits)
            out, self.sent = self.text[self.sent:end], max(self.sent, end)
            return out, True
        hold = max(self.states)
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out, False

    def finish(self, tail: str) -> str:
        """The held-back text (and the decoder's tail) once no stop string followed."""
        self.text += tail
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


@functools.lru_cache(maxsize=64)
def _kmp_table(stop: str) -> tuple:
    """table[i]: the longest proper prefix of stop[:i+1] that is also its suffix."""
    table, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return tuple(table)
