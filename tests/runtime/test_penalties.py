"""Presence / frequency / repetition penalties and logit_bias (penalties.py) against a pure-Python
reference of vLLM's rules on logits, the sampler using them, the stop-string hold-back of the
detokenizer, and the engine with penalties end to end (CPU; CUDA too when there is one)."""
import random

import pytest
import torch
from tokenizers import Tokenizer

from dsquant.assets import tokenizer_path
from dsquant.runtime.engine.detokenizer import IncrementalDetokenizer
from dsquant.runtime.engine.penalties import PenaltyTensors
from dsquant.runtime.engine.sampler import SamplingTensors, sample
from dsquant.runtime.engine.sequence import SamplingParams, Sequence

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 40


def reference(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """vLLM's order, one token at a time: bias, repetition (prompt + output), frequency, presence."""
    out = list(logits)
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        c = output.count(t)
        out[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return out


def make_seq(i, prompt, output, p):
    s = Sequence(i, str(i), prompt, p)
    s.token_ids += output
    return s


CASES = [
    SamplingParams(presence_penalty=0.7),
    SamplingParams(frequency_penalty=-0.4),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8, presence_penalty=-1.5, frequency_penalty=2.0),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0, 39: 0.25}),
    SamplingParams(logit_bias={1: 2.0}, repetition_penalty=1.7, frequency_penalty=0.5),
    SamplingParams(),  # no penalty in a batch that has some
]


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_equal_the_pure_python_reference(device):
    rng = random.Random(0)
    seqs, rows = [], []
    for i, p in enumerate(CASES):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
        seqs.append(make_seq(i, prompt, output, p))
        rows.append((prompt, output, p))
    logits = torch.randn(len(CASES), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    t = PenaltyTensors.from_seqs(seqs, VOCAB, device)
    got = t.apply(logits.to(device)).cpu()
    want = torch.tensor([reference(logits[i].tolist(), *rows[i]) for i in range(len(CASES))])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()


def test_no_penalties_means_no_tensors_and_the_default_path():
    seqs = [make_seq(0, [1, 2], [3], SamplingParams()), make_seq(1, [4], [], SamplingParams(temperature=0))]
    assert PenaltyTensors.from_seqs(seqs, VOCAB, "cpu") is None
    assert not SamplingParams().has_penalties
    assert SamplingParams(logit_bias={}).has_penalties is False


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_applies_penalties_greedy_and_random(device):
    logits = torch.zeros(2, VOCAB, device=device)
    logits[:, 5] = 10.0  # the argmax, unless penalized
    greedy = SamplingParams(temperature=0, logit_bias={9: 20.0})
    rand = SamplingParams(temperature=1.0, seed=3, frequency_penalty=2.0, presence_penalty=2.0)
    seqs = [make_seq(0, [1], [], greedy), make_seq(1, [1], [5] * 5, rand)]
    for s in seqs:
        s.generator = torch.Generator(device=device).manual_seed(0)
    t = SamplingTensors.from_seqs(seqs, VOCAB, device)
    tokens = sample(logits, t, None, PenaltyTensors.from_seqs(seqs, VOCAB, device))
    assert tokens[0].item() == 9 and tokens[1].item() != 5  # 10 - 2 * 5 - 2 < 0 = the rest
    assert sample(logits[:1], SamplingTensors.from_seqs(seqs[:1], VOCAB, device), None).item() == 5  # without them


def test_logit_bias_and_repetition_penalty_in_the_engine(llm_tiny):
    engine = llm_tiny.engine
    forced = llm_tiny.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0, logit_bias={42: 100.0}))[0]
    assert forced.token_ids == [42] * 5
    plain = llm_tiny.generate([[1, 2, 3]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    rep = llm_tiny.generate([[1, 2, 3]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                        repetition_penalty=1e3))[0]
    assert len(set(rep.token_ids)) == len(rep.token_ids) and set(rep.token_ids).isdisjoint({1, 2, 3})
    assert len(set(plain.token_ids)) < len(plain.token_ids) or plain.token_ids != rep.token_ids
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def llm_tiny():
    from dsquant.runtime.llm import LLM

    return LLM("dsq-tiny-qwen2", device="cpu", max_num_seqs=4, max_model_len=64)


def test_stop_string_prefix_is_held_back_until_it_cannot_be_a_stop():
    tok = Tokenizer.from_file(str(tokenizer_path() / "tokenizer.json"))
    text = "the system to the children of the village"
    ids = tok.encode(text, add_special_tokens=False).ids
    for stop, expect in [(" children of the", "the system to the"), (" children of them", text)]:
        d = IncrementalDetokenizer(tok, [stop])
        pieces = [d.add([t]) for t in ids]
        streamed = "".join(pieces) + d.flush()
        assert streamed == d.text == expect, (stop, pieces)
        for k in range(len(pieces)):  # what was streamed so far never runs past the final text
            assert expect.startswith("".join(pieces[:k + 1])), (stop, pieces[:k + 1])
