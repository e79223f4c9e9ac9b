"""dsquant.convert.gguf on a tiny GGUF written here: names, q/k row order, config, tokenizer.

The GGUF is laid out as llama.cpp lays out a Llama: weights stored (in, out), q/k rows of each
head interleaved (RoPE pairs side by side). The converted checkpoint must give transformers'
LlamaForCausalLM, built from the original (HF-layout) weights, the same logits.
"""
import pytest
import torch

gguf = pytest.importorskip("gguf")

from dsquant.convert.gguf import convert_gguf, unpermute_qk  # noqa: E402

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 96


def interleave_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rotate-half row order -> llama.cpp's: per head, row 2i = row i, row 2i+1 = row i + d/2."""
    d = w.shape[0] // n_heads
    heads = w.reshape(n_heads, 2, d // 2, *w.shape[1:])
    return torch.stack([heads[:, 0], heads[:, 1]], dim=2).reshape(w.shape)


def test_unpermute_inverts_interleave():
    w = torch.randn(6 * 16, 5)
    assert torch.equal(unpermute_qk(interleave_qk(w, 6), 6), w)


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=260, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5,
                      max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _write_gguf(model, path):
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + ["Ġt"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for n, p in model.state_dict().items():
        t = p.detach().float()
        if n == "lm_head.weight":
            continue
        if n == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif n == "model.norm.weight":
            name = "output_norm.weight"
        else:
            _, _, i, *rest = n.split(".")
            name = f"blk.{i}.{names['.'.join(rest[:-1])]}.weight"
            if rest[-2] == "q_proj":
                t = interleave_qk(t, HEADS)
            elif rest[-2] == "k_proj":
                t = interleave_qk(t, KV_HEADS)
        w.add_tensor(name, t.numpy())  # numpy (out, in) is GGUF (in, out), as llama.cpp stores it
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_convert_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from dsquant.data.tokenizer import load_tokenizer
    from dsquant.models import load_model

    model = _tiny_model()
    _write_gguf(model, tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", dtype="float32")
    ids = torch.randint(0, 260, (1, 24))
    with torch.no_grad():
        want = model(ids).logits
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
        ours = load_model(out, dtype=torch.float32)(ids)
    ours = getattr(ours, "logits", ours)
    torch.testing.assert_close(hf, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    tok = load_tokenizer(out)
    enc = tok("<|im_start|> t12").input_ids
    assert enc[0] == 1 and tok.decode(enc) == "<|im_start|> t12"
    assert tok.convert_ids_to_tokens(enc[1]) == "Ġt" and len(enc) == 4  # digits split one by one
