from dflash_local.chat.textstream import TextStream


def feed_all(stream, pieces):
    out = "".join(stream.feed(p) for p in pieces)
    return out + stream.flush()


def test_utf8_split_across_tokens():
    raw = "héllo 你好 🚀".encode()
    pieces = [raw[i : i + 1] for i in range(len(raw))]  # one byte per "token"
    s = TextStream()
    deltas = [s.feed(p) for p in pieces]
    assert "".join(deltas) + s.flush() == "héllo 你好 🚀"
    assert all("\ufffd" not in d for d in deltas)


def test_dangling_partial_sequence_is_replaced_at_the_end():
    s = TextStream()
    assert feed_all(s, [b"ok", "你".encode()[:2]]) == "ok\ufffd"


def test_stop_string_split_across_tokens_is_not_emitted():
    s = TextStream(stop=["<END>"])
    deltas = [s.feed(p) for p in [b"abc<", b"EN", b"D>tail"]]
    assert "".join(deltas) + s.flush() == "abc"
    assert s.stopped_by == "<END>"
    assert deltas[0] == "abc"  # the '<' is held back until it is known not to start the stop string


def test_held_text_is_released_when_the_stop_string_does_not_complete():
    s = TextStream(stop=["<END>"])
    assert s.feed(b"a<E") == "a"
    assert s.feed(b"X") == "<EX"
    assert s.flush() == ""
    assert s.stopped_by is None


def test_earliest_of_several_stop_strings_wins():
    s = TextStream(stop=["world", "lo w"])
    assert feed_all(s, [b"hello world"]) == "hel"
    assert s.stopped_by == "lo w"


def test_stop_string_in_multibyte_text():
    s = TextStream(stop=["好"])
    raw = "你好吗".encode()
    assert feed_all(s, [raw[:4], raw[4:]]) == "你"
