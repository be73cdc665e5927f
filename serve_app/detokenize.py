"""Text from token ids as the OpenAI server shows it: incrementally, stop strings applied (`Detokenizer`), and a
token's own string in logprobs (`TokenNames`, `token_id_name`)."""

from __future__ import annotations


class Detokenizer:
    """Incremental text from token ids: holds back a trailing partial UTF-8 character, and the stop strings (a stop
    string counts only where it ends after the text of the first `min_tokens` tokens, as in vLLM)."""

    def __init__(self, tokenizer, stops: list[str], min_tokens: int = 0, keep_stop: bool = False,
                 skip_special: bool = True):
        self.tok, self.stops, self.min_tokens = tokenizer, stops, min_tokens
        self.keep_stop, self.skip_special = keep_stop, skip_special  # vLLM's include_stop_str_in_output, ...
        self.ids: list[int] = []
        self.sent = 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.floor: int | None = None  # the length of the first min_tokens tokens' text, once they are in

    def push(self, ids: list[int], final: bool) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=self.skip_special)
        if self.floor is None and len(self.ids) >= self.min_tokens:
            self.floor = len(self.tok.decode(self.ids[:self.min_tokens], skip_special_tokens=self.skip_special))
        if self.floor is not None:
            found = [(i, len(s)) for s in self.stops if (i := text.find(s, max(0, self.floor - len(s) + 1))) >= 0]
            if found:
                cut, length = min(found)
                text, final = text[:cut + length if self.keep_stop else cut], True
        if not final:
            end = len(text) - self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            text = text[:max(end, self.sent)]
        out, self.sent = text[self.sent:], max(self.sent, len(text))
        return out


class TokenNames:
    """A token's string in logprobs, as vLLM's server writes it: the token decoded alone, with the leading spaces a
    SentencePiece piece ("\u2581") stands for that decoding it alone drops."""

    def __init__(self, tokenizer):
        self.tok, self.names = tokenizer, {}

    def __call__(self, t: int) -> str:
        if t not in self.names:
            text, piece = self.tok.decode([t]), self.tok.convert_ids_to_tokens(t) or ""
            missing = (len(piece) - len(piece.lstrip("\u2581"))) - (len(text) - len(text.lstrip(" ")))
            self.names[t] = " " * missing + text if missing > 0 else text
        return self.names[t]


def token_id_name(t: int) -> str:
    return f"token_id:{t}"  # vLLM's return_tokens_as_token_ids
