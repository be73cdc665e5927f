from engines.sampling import SamplingParams
from engines.stopping import StopChecker


def test_eos_stops_and_is_not_emitted():
    s = StopChecker(SamplingParams(max_tokens=10), eos_token_ids=(0,))
    assert s.feed([5, 6, 0, 7]) == [5, 6]
    assert s.finish_reason == "stop" and s.feed([8]) == []


def test_max_tokens_truncates_a_multi_token_commit():
    s = StopChecker(SamplingParams(max_tokens=3), eos_token_ids=(0,))
    assert s.feed([5, 6]) == [5, 6]
    assert s.feed([7, 8, 9]) == [7]
    assert s.finish_reason == "length"


def test_stop_string_cuts_text_and_drops_later_tokens(tokenizer):
    ids = tokenizer("Hello world. Goodbye moon.", add_special_tokens=False).input_ids
    s = StopChecker(SamplingParams(max_tokens=50, stop=["Good"]), (0,), tokenizer)
    emitted = s.feed(ids)
    assert s.finish_reason == "stop"
    assert s.text == "Hello world. "
    assert len(emitted) < len(ids)
    assert "moon" not in tokenizer.decode(emitted)


def test_ignore_eos():
    s = StopChecker(SamplingParams(max_tokens=4, ignore_eos=True), eos_token_ids=(0,))
    assert s.feed([0, 0, 0, 0, 0]) == [0, 0, 0, 0]
