"""Finding a request's stop strings in its growing text. Prepared once when the request is admitted,
so that each new token costs work in the characters it added, not in the number or length of the
stop strings: a request with thousands of them slows only itself."""

from collections import defaultdict


class StopStrings:
    """A request's stop strings, grouped by length: a stop string that ends inside the newest
    characters is the text's slice of its length ending there, looked up in a set."""

    def __init__(self, stop: list[str]):
        by_length: dict[int, set[str]] = defaultdict(set)
        for s in stop:
            by_length[len(s)].add(s)
        self._by_length = sorted(by_length.items())
        self.longest = self._by_length[-1][0] if self._by_length else 0
        """The longest stop string's length: a running request holds back this many characters less one."""

    def find(self, text: str, new_chars: int) -> tuple[int, str] | None:
        """(where it starts, which) of the earliest stop string that ends in the last `new_chars`
        characters of `text`, or None. Stop strings that ended earlier were found when those characters came."""
        first: tuple[int, str] | None = None
        for end in range(len(text) - new_chars + 1, len(text) + 1):
            for length, strings in self._by_length:
                start = end - length
                if start < 0:
                    break
                if (first is None or start < first[0]) and text[start:end] in strings:
                    first = start, text[start:end]
        return first
