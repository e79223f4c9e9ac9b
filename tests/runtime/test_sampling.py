"""Sampler, detokenizer, block manager units, and the generate command / LLM API with a tokenizer."""
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer

from dsquant.assets import tokenizer_path
from dsquant.runtime.engine.block_manager import BlockManager
from dsquant.runtime.engine.detokenizer import IncrementalDetokenizer
from dsquant.runtime.engine.sampler import SamplingTensors, sample
from dsquant.runtime.engine.sequence import SamplingParams, Sequence


def seqs(*params):
    out = []
    for i, p in enumerate(params):
        s = Sequence(i, str(i), [1], p)
        if p.seed is not None:
            s.generator = torch.Generator().manual_seed(p.seed)
        out.append(s)
    return out


def draw(logits, *params):
    return sample(logits, SamplingTensors.from_seqs(seqs(*params), logits.shape[-1], "cpu"),
                  torch.Generator().manual_seed(0))


def test_greedy_top_k1_and_tiny_top_p_all_pick_the_argmax():
    logits = torch.randn(4, 50)
    out = draw(logits, SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=1),
               SamplingParams(temperature=1.0, top_p=1e-6), SamplingParams(temperature=0, top_k=3))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_a_given_greedy_argmax_serves_the_greedy_rows_unless_penalties_change_the_logits():
    """The decode graph's in-graph argmax (cuda_graph.GREEDY_IN_GRAPH) stands in for greedy_argmax: a
    greedy batch returns it as is, a mixed batch takes its greedy rows from it, penalties discard it."""
    from dsquant.runtime.engine.penalties import PenaltyTensors

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, generator=g)
    marker = torch.tensor([7, 11, 13])  # not the argmax: shows where the given one is used
    greedy = seqs(*[SamplingParams(temperature=0)] * 3)
    t = SamplingTensors.from_seqs(greedy, 40, "cpu")
    assert sample(logits, t, greedy=marker) is marker
    mixed = seqs(SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0))
    got = sample(logits, SamplingTensors.from_seqs(mixed, 40, "cpu"), torch.Generator().manual_seed(0), greedy=marker)
    assert got[0] == 7 and got[2] == 13 and got[1] != 11
    penalized = seqs(*[SamplingParams(temperature=0, presence_penalty=0.5)] * 3)
    pen = PenaltyTensors.from_seqs(penalized, 40, "cpu")
    out = sample(logits, SamplingTensors.from_seqs(penalized, 40, "cpu"), penalties=pen, greedy=marker)
    assert torch.equal(out, pen.apply(logits.clone()).argmax(-1))


def test_seeded_request_is_reproducible_regardless_of_batch():
    logits = torch.randn(1, 100)
    p = SamplingParams(temperature=1.0, seed=123)
    alone = [draw(logits, p).item() for _ in range(3)]
    batched = draw(torch.cat([torch.randn(2, 100), logits]), SamplingParams(temperature=1.0),
                   SamplingParams(temperature=0.7), p)[2].item()
    assert len(set(alone)) == 1 and batched == alone[0]


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0]]).repeat(400, 1)
    k2 = draw(logits, *[SamplingParams(temperature=2.0, top_k=2)] * 400)
    assert set(k2.tolist()) == {0, 1}
    p = torch.softmax(logits[0], -1)  # p0 ~ 0.64, p0 + p1 ~ 0.88
    top_p = draw(logits, *[SamplingParams(temperature=1.0, top_p=0.8)] * 400)
    assert set(top_p.tolist()) == {0, 1} and p[0] < 0.8 < p[0] + p[1]
    free = draw(logits, *[SamplingParams(temperature=1.0)] * 400)
    assert abs((free == 0).float().mean().item() - p[0].item()) < 0.08  # the exponential race samples p


def test_incremental_detokenization_equals_full_decode_and_cuts_at_stop_strings():
    tok = Tokenizer.from_file(str(tokenizer_path() / "tokenizer.json"))
    text = "Grüße, 世界! def f(x):\n    return x ** 2  # done"
    ids = tok.encode(text, add_special_tokens=False).ids
    d = IncrementalDetokenizer(tok)
    assert "".join(d.add([i]) for i in ids) == tok.decode(ids) == d.text
    d = IncrementalDetokenizer(tok, stop=["return"])
    pieces = [d.add([i]) for i in ids]
    assert d.stopped_on == "return" and d.text == text[:text.index("return")]
    assert "".join(pieces) == d.text


def test_detokenizer_writes_out_tokens_that_never_form_text():
    """A model that emits tokens which never complete a character (a lone UTF-8 continuation byte
    repeated, ids past the tokenizer's vocabulary) gets them written out lossily every few tokens,
    so no step re-decodes an ever longer tail (it did: 290 us a token after 2000 such tokens), and
    the valid text around them comes through intact."""
    from dsquant.runtime.engine.detokenizer import MAX_STALLED

    tok = Tokenizer.from_file(str(tokenizer_path() / "tokenizer.json"))
    lone = tok.token_to_id("Ã")  # byte 0xC3 on its own: starts a character that never ends
    oov = tok.get_vocab_size() + 1000
    before, after = tok.encode("Hello wörld", add_special_tokens=False).ids, tok.encode(" 日本 ok",
                                                                                      add_special_tokens=False).ids
    for junk in ([lone] * 300, [oov] * 300, [lone, oov] * 150):
        d = IncrementalDetokenizer(tok)
        for t in before + junk + after:
            d.add([t])
            assert len(d.stalled) < MAX_STALLED  # the stream never holds more than a few pending tokens
        assert d.text.startswith("Hello wörld") and d.text.endswith(" 日本 ok")
        if lone in junk:  # invalid bytes come out as U+FFFD, as tokenizer.decode writes them
            assert d.text.count("\ufffd") >= 150
    # a valid character right after junk is not lost to the write-out
    d = IncrementalDetokenizer(tok)
    emoji = tok.encode("é", add_special_tokens=False).ids
    assert "".join(d.add([t]) for t in [lone] * (MAX_STALLED - 1) + emoji).endswith("é")


def test_block_manager_refcounts_hash_chain_and_eviction():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = Sequence(0, "a", [1, 2, 3, 4, 5], SamplingParams())
    bm.admit(a, bm.match_prefix(a))
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.register_full_blocks(a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 3
    b = Sequence(1, "b", [1, 2, 3, 4, 9, 9], SamplingParams())
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    bm.admit(b, hits)
    assert b.num_computed_tokens == 4 and bm.blocks[hits[0]].ref_count == 2
    c = Sequence(2, "c", [7, 2, 3, 4, 9], SamplingParams())  # same 2nd block, different 1st: no hit
    assert bm.match_prefix(c) == []
    bm.free_seq(a)
    assert bm.blocks[hits[0]].ref_count == 1
    bm.free_seq(b)
    assert bm.num_free_blocks == 6
    d = Sequence(3, "d", [1, 2, 3, 4, 5], SamplingParams())
    assert bm.match_prefix(d) == hits  # freed blocks stay cached until reused
    for _ in range(6):
        bm._take_free()
    assert bm.match_prefix(d) == [] and not bm.hash_to_block


def test_generate_command_and_llm_api(llama_with_tokenizer):
    import dsquant
    from dsquant.cli import cli

    _, path = llama_with_tokenizer
    args = [str(path), "--prompt", "Once upon a time", "--max-tokens", "6", "--temperature", "0", "--device", "cpu"]
    result = CliRunner().invoke(cli, ["generate", *args])
    assert result.exit_code == 0, result.output
    llm = dsquant.LLM(path, device="cpu", dtype=torch.float32, num_blocks=32)
    out = llm.generate(["Once upon a time", "Hello"], dsquant.SamplingParams(max_tokens=6, temperature=0))
    assert 0 < len(out[0].token_ids) <= 6 and out[0].finish_reason in ("stop", "length")
    assert result.output == out[0].text + "\n"
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert out[1].text == tok.decode(out[1].token_ids, skip_special_tokens=True)
