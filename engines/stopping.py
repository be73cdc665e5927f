"""Stop conditions: EOS, stop token ids, stop strings and max_tokens. Nothing past a stop is emitted."""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.sampling import SamplingParams


@dataclass
class StopChecker:
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    tokenizer: object | None = None  # needed for stop strings only
    generated: list[int] = field(default_factory=list)
    text: str = ""
    _min_text: str = field(default="", init=False)  # the text of the first min_tokens tokens
    finish_reason: str | None = None

    def __post_init__(self):
        if self.params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self._stop_ids = set(self.params.stop_token_ids) | (set() if self.params.ignore_eos
                                                             else set(self.eos_token_ids))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, tokens: list[int]) -> list[int]:
        """Append tokens one by one until a stop; return the ones that are emitted. As in vLLM, nothing but the
        length stops a request before `min_tokens`, and a stop string must end in the text after them."""
        out: list[int] = []
        for tok in tokens:
            if self.finished:
                break
            if tok in self._stop_ids and len(self.generated) >= self.params.min_tokens:
                self.finish_reason = "stop"
                break
            self.generated.append(tok)
            out.append(tok)
            if self.params.stop:
                text = self.tokenizer.decode(self.generated, skip_special_tokens=True)
                if len(self.generated) <= self.params.min_tokens:
                    self._min_text = text
                hits = [text.find(s, max(0, len(self.text) - len(s), len(self._min_text) - len(s) + 1))
                        for s in self.params.stop]
                hits = [h for h in hits if h >= 0]
                if hits:
                    self.text = text[:min(hits)]
                    self.finish_reason = "stop"
                    break
                self.text = text
            if len(self.generated) >= self.params.max_tokens:
                self.finish_reason = "length"
        return out
