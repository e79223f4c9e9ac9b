"""Greedy tokens through the paged CPU engine equal transformers' generate, per family."""
import pytest
import torch

from dsquant.assets import bundled_model_path, bundled_models
from dsquant.runtime.engine.llm_engine import EngineConfig
from dsquant.runtime.engine.sequence import SamplingParams
from dsquant.runtime.llm import LLM

from conftest import FAMILIES, hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def cpu_llm(path, **kw) -> LLM:
    base = dict(device="cpu", dtype=torch.float32, block_size=4, num_blocks=128, max_model_len=256)
    return LLM(path, EngineConfig(**{**base, **kw}))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers(family, tiny_models):
    """Two prompts in one batch (one spans several blocks, with a partial last block)."""
    hf, path = tiny_models[family]
    prompts = random_prompts(2, [13, 5], seed=1)
    outs = cpu_llm(path).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 6), family
        assert out.finish_reason == "length"


@pytest.mark.parametrize("name", bundled_models() or ["(none bundled yet)"])
def test_bundled_model_greedy_matches_transformers(name):
    if name not in bundled_models():
        pytest.skip("no bundled model in this checkout")
    import transformers

    path = bundled_model_path(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = cpu_llm(path, block_size=16, num_blocks=64)
    prompt = llm.engine.encode("The quick brown fox jumps over the lazy dog. def main():")
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 8)
