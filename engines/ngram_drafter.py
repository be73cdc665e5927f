"""The n-gram drafter (prompt lookup decoding): the token that followed the context's last n tokens earlier in the
same request, for the longest n in [min_n, max_n] that occurred before; vLLM's `ngram` method, as a member of the
roster. No model: a dict of n-grams per request, each with the tokens that followed it and how often. Its
confidence is engines/model_free.py's (the continuation's frequency after the n-gram, one pseudo-count for the
occurrence being drafted)."""

from __future__ import annotations

from engines.model_free import LookupState, Match, ModelFreeDrafter


class NgramDrafterEngine(ModelFreeDrafter):
    def __init__(self, name: str, min_n: int = 2, max_n: int = 5, max_requests: int = 64, max_len: int = 2048,
                 min_prob: float = 0.0):
        super().__init__(name, max_requests, max_len, min_prob)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram drafter {name}: need 1 <= min_n ({min_n}) <= max_n ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.window = max_n

    def _new_index(self, state: LookupState) -> dict[tuple[int, ...], dict[int, tuple[int, int]]]:
        return {}  # n-gram -> {next token: (count, position of its first occurrence)}

    def _grams(self, tokens: list[int]):
        """The n-grams that end just before the last token, with that token: what its position indexes."""
        j = len(tokens) - 1
        for n in range(self.min_n, min(self.max_n, j) + 1):
            yield tuple(tokens[j - n:j]), tokens[j], j

    def _append(self, rid: str, token: int) -> None:
        st = self.states[rid]
        for key, t, j in self._grams(st.tokens):
            nexts = st.index.setdefault(key, {})
            count, first = nexts.get(t, (0, j))
            nexts[t] = (count + 1, first)

    def _pop(self, rid: str) -> None:
        st = self.states[rid]
        for key, t, _ in self._grams(st.tokens):
            nexts = st.index[key]
            count, first = nexts[t]
            if count > 1:
                nexts[t] = (count - 1, first)
            else:
                del nexts[t]
                if not nexts:
                    del st.index[key]

    def _match(self, rid: str, query: list[int]) -> Match | None:
        index = self.states[rid].index
        for n in range(min(self.max_n, len(query)), self.min_n - 1, -1):
            nexts = index.get(tuple(query[-n:]))
            if nexts:
                return Match(n, nexts)
        return None
