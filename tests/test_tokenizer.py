"""Incremental detokenization: multi-byte characters, and an output decoded after its prompt."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minibatch.tokenizer import IncrementalDetokenizer, decode_output, load_tokenizer, prompt_context

TINY = load_tokenizer(__import__("pathlib").Path(__file__).resolve().parents[1] / "minibatch" / "assets" / "tiny")


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A Llama-2-style tokenizer (Metaspace "▁" words, a decoder that strips the text's first
    space), trained here on a few sentences: ``decode(["▁world"])`` is ``"world"``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.train_from_iterator(["hello world the world is big", "the little cat sat on the mat hello there"] * 20,
                           trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def test_an_output_keeps_the_space_before_its_first_word(sentencepiece_like):
    tok = sentencepiece_like
    prompt, output = tok.encode("hello", add_special_tokens=False), tok.encode("world", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(output) == ["▁world"] and tok.decode(output) == "world"
    d = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert [d.push(t) for t in output] == [" world"] and d.text == " world"
    assert decode_output(tok, output, prompt_context(tok, prompt)) == " world"
    # Without the prompt there is nothing to continue: the old, context-free decode.
    bare = IncrementalDetokenizer(tok)
    assert [bare.push(t) for t in output] == ["world"]


def test_the_engine_streams_and_finishes_with_the_text_as_it_follows_the_prompt(sentencepiece_like):
    from test_engine import engine, greedy

    tok = sentencepiece_like
    world = tok.encode("world is big", add_special_tokens=False)
    e = engine(script={"a": world})
    e.tokenizer = tok
    e.stream_text = True
    e.add_request(tok.encode("hello", add_special_tokens=False), greedy(max_tokens=len(world), ignore_eos=True),
                  request_id="a")
    seen = []
    while e.has_unfinished_requests():
        e.step()
        seen.append(e.requests["a"].output_text)
    assert seen[0] == " world" and e.output("a").outputs[0].text == " world is big"


def test_a_prompt_ending_inside_a_character_primes_nothing():
    ids = TINY.encode("喝咖", add_special_tokens=False)        # 咖 spans two byte-level tokens
    assert "\ufffd" in TINY.decode(ids[:-1])
    assert prompt_context(TINY, ids[:-1]) == []
    assert prompt_context(TINY, ids) == ids                   # short and complete: the whole prompt


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.text(alphabet="从前有一只小猫咖啡喵😀 Once upon a time,.", min_size=1, max_size=16),
       st.text(alphabet="从前有一只小猫咖啡喵😀 Once upon a time,.", min_size=1, max_size=16))
def test_pieces_join_to_the_output_text_after_the_prompt(prompt, output):
    """With the byte-level tiny tokenizer the pieces never carry U+FFFD and join to the
    decode of prompt + output less the prompt's context, which is the output's own decode."""
    p_ids = TINY.encode(prompt, add_special_tokens=False)
    o_ids = TINY.encode(output, add_special_tokens=False)
    d = IncrementalDetokenizer(TINY, prompt_ids=p_ids)
    pieces = [d.push(t) for t in o_ids]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == decode_output(TINY, o_ids, prompt_context(TINY, p_ids)) == TINY.decode(o_ids)
