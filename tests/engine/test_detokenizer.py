"""The incremental detokenizer against its reference: `tokenizer.decode` of the whole output.

Reference: after each token, the streamed text is the whole output decoded less any
trailing incomplete character (U+FFFD), and the final text equals the whole decode
exactly. Tolerance: none, the texts are compared character for character.
"""

import random

import pytest

from vlm_catalog.engine.detokenizer import Detokenizer
from vlm_catalog.model.tiny_checkpoint import build_tokenizer

TEXTS = [
    "Pre-owned Zed Polo, size M",
    "Café crème — 250 g, ½ price",
    "日本製の陶器カップ",
    "Emoji 🎉🚀 and ümlauts",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(1000)


def _sequences(tokenizer, count: int = 40) -> list[list[int]]:
    """Real texts, special tokens mixed in, ids past the tokenizer (padded vocabulary), and
    random ids (byte-level pieces that need not form whole characters)."""
    rng = random.Random(7)
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    sequences = [tokenizer.encode(text) for text in TEXTS]
    sequences.append(tokenizer.encode(TEXTS[1]) + [special] + tokenizer.encode(TEXTS[3]) + [len(tokenizer) + 3])
    for _ in range(count):
        sequences.append([rng.randrange(len(tokenizer) + 8) for _ in range(rng.randrange(1, 40))])
    return sequences


def _reference(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode([t for t in ids if t < len(tokenizer)], skip_special_tokens=True)


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_is_the_whole_decode_without_an_unfinished_end(tokenizer, chunk):
    """The final text too: an unfinished character at its very end (U+FFFD) is left out, as vLLM does;
    before, an answer cut by max_tokens mid-character ended in U+FFFD."""
    for ids in _sequences(tokenizer):
        detokenizer = Detokenizer(tokenizer)
        assert detokenizer._stream is not None  # the incremental path is the one under test
        streamed = ""
        for end in list(range(chunk, len(ids), chunk)) + [len(ids)]:
            detokenizer.update(ids[:end])
            whole = _reference(tokenizer, ids[:end])
            assert whole.startswith(detokenizer.text), (ids[:end], detokenizer.text, whole)
            rest = whole[len(detokenizer.text):]  # held back: only while the decode ends unfinished
            assert rest == "" or rest.endswith("\ufffd"), (ids[:end], rest)
            streamed += detokenizer.delta()
        detokenizer.finish(ids)
        streamed += detokenizer.delta(final=True)
        assert detokenizer.text == _reference(tokenizer, ids).rstrip("\ufffd")
        assert streamed == detokenizer.text


def test_a_multibyte_character_is_held_back_until_complete(tokenizer):
    piece_ids = [tokenizer.convert_tokens_to_ids(piece) for piece in tokenizer.convert_ids_to_tokens(tokenizer.encode("🎉"))]
    by_byte = [tokenizer.convert_tokens_to_ids(ch) for ch in "".join(tokenizer.convert_ids_to_tokens(piece_ids))]
    assert len(by_byte) == 4  # one byte-level token per UTF-8 byte of the emoji
    detokenizer = Detokenizer(tokenizer)
    for end in range(1, 4):
        detokenizer.update(by_byte[:end])
        assert detokenizer.text == "" and detokenizer.delta() == ""
    detokenizer.update(by_byte)
    assert detokenizer.delta() == "🎉"


def test_stop_strings_cut_the_text_and_latch(tokenizer):
    ids = tokenizer.encode("size M, colour red. END of listing")
    detokenizer = Detokenizer(tokenizer, stop=["END"])
    stopped_at = next(end for end in range(1, len(ids) + 1) if detokenizer.update(ids[:end]))
    assert detokenizer.text == "size M, colour red. "
    assert _reference(tokenizer, ids[:stopped_at]).startswith("size M, colour red. END")
    assert detokenizer.update(ids) is True and detokenizer.text == "size M, colour red. "
    detokenizer.finish(ids)
    assert detokenizer.text == "size M, colour red. "
    kept = Detokenizer(tokenizer, stop=["END"], include_stop=True)
    kept.finish(ids)
    assert kept.text == "size M, colour red. END"


class CleaningUpTokenizer:
    """A tokenizer without a `tokenizers` backend whose decode cleans up spaces before punctuation
    unless told not to (as transformers' slow tokenizers do)."""

    backend_tokenizer = None

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __len__(self) -> int:
        return len(self.tokenizer)

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=True) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text.replace(" ,", ",").replace(" .", ".") if clean_up_tokenization_spaces else text


def test_a_tokenizer_that_cleans_up_spaces_streams_deltas_that_add_up(tokenizer):
    """Such a tokenizer decoded the whole output each step, cleaned up: that rewrote text already
    sent, so its deltas did not add up ("a b c" streamed for "a, b. c"). Now no cleanup, as in vLLM."""
    cleaning = CleaningUpTokenizer(tokenizer)
    ids = tokenizer.encode("a , b . c")
    detokenizer = Detokenizer(cleaning)
    assert detokenizer._stream is None
    assert _stream(detokenizer, ids) == detokenizer.text == "a , b . c"


def _stream(detokenizer, ids, step=1) -> str:
    """The deltas a stream sends, token by token, the engine's way (update, then delta)."""
    streamed = ""
    for end in range(step, len(ids) + 1, step):
        if detokenizer.update(ids[:end]):
            break
        streamed += detokenizer.delta()
    detokenizer.finish(ids[:end])
    return streamed + detokenizer.delta(final=True)


@pytest.mark.parametrize("stop", [[" red"], ["red.", "M, c"], ["xyz", ", colour"]])
def test_a_stream_never_sends_part_of_a_stop_string(tokenizer, stop):
    """Before, a stream sent "M," before ", colour" completed, though the final text ends before it."""
    ids = tokenizer.encode("size M, colour red. END")
    detokenizer = Detokenizer(tokenizer, stop=stop)
    streamed = _stream(detokenizer, ids)
    assert streamed == detokenizer.text and detokenizer.stopped
    first = min(("size M, colour red. END".find(s), s) for s in stop if s in "size M, colour red. END")
    assert detokenizer.text == "size M, colour red. END"[: first[0]]  # the earliest stop cuts, whatever its place


def test_a_stream_with_a_stop_string_that_never_comes_sends_everything(tokenizer):
    ids = tokenizer.encode("size M, colour red")
    for include_stop in (False, True):
        detokenizer = Detokenizer(tokenizer, stop=["never here"], include_stop=include_stop)
        assert _stream(detokenizer, ids) == _reference(tokenizer, ids) == detokenizer.text


def _with_piece(tokenizer, piece: str):
    """A copy of `tokenizer` with one more vocabulary piece (byte-level, as GPT-2/Qwen spell them); its id."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    vocab[piece] = max(vocab.values()) + 1
    copy = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    return copy, vocab[piece]


def test_a_stop_string_the_held_back_last_token_completes_is_cut_from_the_final_text(tokenizer):
    """The last token " \xe2\x80" (byte-level "ĠâĢ", as real vocabularies merge the start of ' “')
    ends the stop string "M " and begins an unfinished character: the stream held it back, so no
    update saw the stop, and the final decode kept "M \ufffd" in the text."""
    with_piece, piece = _with_piece(tokenizer, "ĠâĢ")
    ids = with_piece.encode("size M") + [piece]
    assert with_piece.decode(ids) == "size M \ufffd"
    detokenizer = Detokenizer(with_piece, stop=["M "])
    streamed = _stream(detokenizer, ids)
    assert detokenizer.text == streamed == "size " and detokenizer.stopped


def test_the_text_of_a_stop_token_that_ended_the_answer_is_left_out(tokenizer):
    """As vLLM: `stop_token_ids` end the answer without their text, unless `include_stop`."""
    ids = tokenizer.encode("size M, colour")
    stop_token = ids[-1]

    def stream(detokenizer):  # the engine's way: the stop token ends the answer, so only `finish` sees it
        streamed = ""
        for end in range(1, len(ids)):
            detokenizer.update(ids[:end])
            streamed += detokenizer.delta()
        detokenizer.finish(ids)
        return streamed + detokenizer.delta(final=True)

    left_out = Detokenizer(tokenizer, stop_token_ids=[stop_token])
    assert stream(left_out) == left_out.text == _reference(tokenizer, ids[:-1])
    kept = Detokenizer(tokenizer, include_stop=True, stop_token_ids=[stop_token])
    assert stream(kept) == kept.text == _reference(tokenizer, ids)
    elsewhere = Detokenizer(tokenizer, stop_token_ids=[stop_token])  # only as the last token
    elsewhere.finish(ids + tokenizer.encode(" red"))
    assert elsewhere.text == _reference(tokenizer, ids + tokenizer.encode(" red"))


def test_a_replacement_character_written_whole_stays_inside_the_text(tokenizer):
    """At the very end a U+FFFD written whole cannot be told from an unfinished character (a stream holds
    both back, as vLLM's does), so it is left out there; inside the text it stays."""
    ids = tokenizer.encode("ok \ufffd")
    inside = ids + tokenizer.encode(" end")
    detokenizer = Detokenizer(tokenizer)
    assert _stream(detokenizer, inside) == detokenizer.text == "ok \ufffd end"
    at_the_end = Detokenizer(tokenizer)
    assert _stream(at_the_end, ids) == at_the_end.text == "ok "
