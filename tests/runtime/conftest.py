"""Tiny random models of each family, written by transformers' save_pretrained, for engine tests.

bench.random_model.random_hf_model builds them: weights redrawn with a wide spread so greedy
decisions depend on every part of the model (attention over the whole context, routing, rope
positions). Models are built once per session.
"""
import pytest
import torch

from dsquant.bench.random_model import copy_tokenizer, random_hf_model
from dsquant.models.checkpoint import layer_of

VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6)
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
           moe_intermediate_size=32, num_key_value_heads=4)
FAMILIES = {  # family -> config.json-style dict (architectures names the transformers class)
    "deepseek_v2": dict(
        architectures=["DeepseekV2ForCausalLM"], **BASE, **MLA, q_lora_rank=None, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, topk_method="greedy",
        norm_topk_prob=False, routed_scaling_factor=1.0),
    "deepseek_v3": dict(
        architectures=["DeepseekV3ForCausalLM"], **BASE, **MLA, q_lora_rank=32, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "beta_fast": 32, "beta_slow": 1}),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], **BASE, num_key_value_heads=2),
    "llama": dict(architectures=["LlamaForCausalLM"], **BASE, num_key_value_heads=2),
}


def build_hf(family: str, seed: int = 0, **overrides):
    """The family's tiny transformers model, config fields `overrides` changed."""
    return random_hf_model({**FAMILIES[family], **overrides}, seed)


@pytest.fixture
def one_thread():
    """One torch thread for the test (tensor-parallel ranks share a 2-core machine), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def wide_moe(tmp_path_factory):
    """A DeepSeek-V2 whose experts are 128 x 128, the smallest the INT4 / FP8 grouped GEMMs take."""
    path = tmp_path_factory.mktemp("wide_moe")
    build_hf("deepseek_v2", hidden_size=128, intermediate_size=128, moe_intermediate_size=128).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> (hf model, checkpoint dir)."""
    out = {}
    for family in FAMILIES:
        model = build_hf(family)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        out[family] = (model, path)
    return out


@pytest.fixture(scope="session")
def llama_with_tokenizer(tmp_path_factory):
    """A tiny Llama over the bundled tokenizer's 8192 tokens, tokenizer files alongside."""
    model = build_hf("llama", seed=3, vocab_size=8192)
    path = tmp_path_factory.mktemp("llama_tok")
    model.save_pretrained(path)
    copy_tokenizer(path)
    return model, path


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def random_prompts(n: int, lengths, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def finished_outputs(eng, prompts, params) -> list:
    """Each prompt's finished RequestOutput after stepping the engine until every request is done."""
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return [done[i] for i in ids]


def assert_logprobs_close(ref: list, ker: list, max_tokens: int, what: str = "") -> None:
    """vLLM's check_logprobs_close rule: greedy tokens equal up to the first difference, where each
    path's token is among the other's top logprobs (outputs from finished_outputs, logprobs requested)."""
    for r, k in zip(ref, ker):
        assert len(r.token_ids) == len(k.token_ids) == max_tokens
        for step, (a, b) in enumerate(zip(r.token_ids, k.token_ids)):
            if a != b:
                assert a in k.logprobs[step][1] and b in r.logprobs[step][1], (
                    f"{what}step {step}: reference token {a} / kernel token {b} not in each other's top 5")
                break


class DictReader:
    """The slice of CheckpointReader that shard_linear reads."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def layer_keys(self, layer):
        return [k for k in self.tensors if layer_of(k) == layer]

    def get(self, key):
        return self.tensors[key]

    def __contains__(self, key):
        return key in self.tensors


def eager_graphs_class():
    """A fresh DecodeGraphs stand-in class (its own replay counters) for the decode-graph path on CPU:
    replay runs the model eagerly on the graphs' static buffers, with the host lengths torch attention
    reads; replay_burst first advances those buffers one step as the burst graphs' head does."""
    from dsquant.runtime.engine.cuda_graph import DecodeGraphs
    from dsquant.runtime.engine.multi_step import advance_static_inputs
    from dsquant.runtime.engine.sampler import greedy_argmax
    from dsquant.runtime.layers.attention import PagedContext

    class EagerGraphs(DecodeGraphs):
        replays = bursts = 0

        def replay(self, n):
            EagerGraphs.replays += 1
            r, lens = self.runner, self.seq_lens[:n].tolist()
            cos, sin = r.model.rope_cos_sin(self.positions[None, :n])
            ctx = PagedContext(cos=cos, sin=sin, slot_mapping=self.slot_mapping[:n],
                               block_tables=self.block_tables[:n], seq_lens=self.seq_lens[:n],
                               cu_seqlens_q=self.cu_seqlens_q[:n + 1], max_seq_len=max(lens), is_decode=True,
                               q_lens_host=[1] * n, seq_lens_host=lens)
            return r.forward(self.input_ids[:n], self.positions[:n], ctx, self.rows[:n])

        def replay_burst(self, n):
            EagerGraphs.bursts += 1
            advance_static_inputs(self, self.bucket[n], self.runner.config.block_size)
            logits = self.replay(n)
            return logits, greedy_argmax(logits)

    return EagerGraphs
