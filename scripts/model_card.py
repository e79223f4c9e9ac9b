"""Write MODEL_CARD.md for a bundled reference model from its config.json, training.json
(scripts/train_reference.py) and eval.json (scripts/eval_reference.py).

    python scripts/model_card.py dsquant/assets/models/dsq-tiny-v3
"""
import json
import sys
from pathlib import Path

CONFIG_FIELDS = {
    "DeepseekV3ForCausalLM": [
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
        "first_k_dense_replace", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
        "num_experts_per_tok", "n_group", "topk_group", "topk_method", "scoring_func",
        "routed_scaling_factor", "norm_topk_prob", "rope_interleave", "rope_parameters",
        "max_position_embeddings", "tie_word_embeddings",
    ],
    "Qwen2ForCausalLM": [
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size", "rope_parameters",
        "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps",
    ],
}
PURPOSE = {
    "DeepseekV3ForCausalLM": (
        "A tiny DeepSeek-V3-architecture model: MLA with q LoRA and YaRN RoPE, a dense first layer, "
        "then MoE layers with 16 routed experts (sigmoid scores, e_score_correction_bias, grouped "
        "top-4 over 2 of 4 groups, noaux_tc) and one shared expert."
    ),
    "Qwen2ForCausalLM": (
        "A tiny Qwen2-architecture model (the R1-Distill-Qwen family): GQA with q/k/v bias, dense "
        "SwiGLU MLP, tied input and output embeddings."
    ),
}


def _load(model_dir: Path, name: str) -> dict:
    return json.loads((model_dir / name).read_text())


def expert_table(loads: dict[str, list[int]]) -> list[str]:
    layers = sorted(loads, key=int)
    n = len(loads[layers[0]])
    lines = [
        "| layer | " + " | ".join(f"e{i}" for i in range(n)) + " | min/mean | max/mean |",
        "| --- " * (n + 3) + "|",
    ]
    for layer in layers:
        counts = loads[layer]
        mean = sum(counts) / n
        lines.append(
            f"| {layer} | " + " | ".join(str(c) for c in counts)
            + f" | {min(counts) / mean:.2f} | {max(counts) / mean:.2f} |"
        )
    return lines


def card_text(model_dir: Path) -> str:
    config, training, evaluation = (_load(model_dir, f) for f in ("config.json", "training.json", "eval.json"))
    arch = config["architectures"][0]
    shards = sorted(model_dir.glob("*.safetensors"))
    disk = sum(p.stat().st_size for p in shards)
    s = training["settings"]
    out = [
        f"# {model_dir.name}",
        "",
        PURPOSE[arch] + " Trained from scratch by dsquant as a reference for measuring what "
        "quantization costs; not a useful language model.",
        "",
        "Loads offline with `transformers.AutoModelForCausalLM.from_pretrained(dir)` and "
        "`dsquant.models.load_model(dir)`. The tokenizer files beside it are dsquant's bundled "
        "byte-level BPE tokenizer (vocabulary 8192, trained on the same training text); load them "
        "with `transformers.PreTrainedTokenizerFast.from_pretrained(dir)` or "
        "`dsquant.data.load_tokenizer(dir)`, which keep tokenizer.json's pre-tokenizer.",
        "",
    ]
    if arch == "Qwen2ForCausalLM":
        out += [
            "**Tokenizer caveat:** transformers 5.17's `AutoTokenizer.from_pretrained(dir)` returns a "
            "`Qwen2Tokenizer` for any `model_type: qwen2` directory and replaces tokenizer.json's "
            "pre-tokenizer with Qwen2's (NFC, digits split one by one). That is not how this model "
            "was trained: its perplexity is worse under it. Use the loaders above.",
            "",
        ]
    out += [
        "## Config",
        "",
        f"`{arch}` (transformers {config.get('transformers_version', '?')}); "
        f"{training['parameters']:,} parameters; {len(shards)} bf16 safetensors shard(s), "
        f"{disk / 1e6:.1f} MB on disk"
        + ("; `e_score_correction_bias` kept in float32." if arch == "DeepseekV3ForCausalLM" else "."),
        "",
        "| field | value |",
        "| --- | --- |",
    ]
    for field in CONFIG_FIELDS[arch]:
        if field in config:
            out.append(f"| {field} | `{json.dumps(config[field])}` |")
    out += [
        "",
        "## Training",
        "",
        f"- data: train.jsonl.xz of the shared corpora ({training['corpus_tokens']:,} tokens; "
        "see dsquant/assets/data/LICENSES.md), BOS + document + EOS, windows of "
        f"{s['seqlen']} tokens at seeded random offsets",
        f"- {training['steps']:,} steps x {s['batch_size']} sequences x {s['seqlen']} tokens = "
        f"{training['tokens']:,} training tokens in {training['train_seconds']:.0f} s on "
        f"{training['device']} (torch {training['torch']}, experts: {training['experts_implementation']})",
        f"- AdamW (betas 0.9/0.95, weight decay {s['weight_decay']} on matrices), peak lr {s['lr']}, "
        f"{s['warmup_steps']} warm-up steps then cosine to {s['min_lr_ratio']} x peak, gradient "
        f"clip {s['grad_clip']}, bf16 autocast over fp32 weights, seed {s['seed']}",
        f"- final training loss (mean of the last 50 steps): {training['final_train_loss']:.3f}",
    ]
    if arch == "DeepseekV3ForCausalLM":
        out.append(
            f"- load balancing: DeepSeek-V3's auxiliary-loss-free rule; after every step "
            f"`e_score_correction_bias += {s['bias_update_gamma']} * sign(mean load - expert load)`, "
            "loads counted from each router's top-k indices (no auxiliary loss)"
        )
    out += [f"- reproduce: `{training['rerun']}`", ""]
    w, st, sl = evaluation["window"], evaluation["stride"], evaluation["slice_tokens"]
    out += [
        "## Evaluation",
        "",
        f"Perplexity over sliding windows of {w} tokens every {st} tokens (each token scored once, "
        f"with at least {w - st} tokens of context past the first window), float32 on "
        f"{evaluation['device']}. Unigram baselines score the same tokens: *train-fit* is a "
        "unigram model of the training stream with add-one smoothing, *own* uses the evaluated "
        "text's own token frequencies (the best any unigram model can do on it). The slice "
        f"column is the first {sl} tokens of each set, recomputed on CPU by "
        "tests/assets/test_bundled_models.py (within 1%).",
        "",
        "| set | tokens | perplexity | unigram (train-fit) | unigram (own) | slice perplexity |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in evaluation["sets"].items():
        out.append(
            f"| {name} | {r['tokens']:,} | {r['perplexity']:.2f} | {r['unigram_train_perplexity']:.1f} | "
            f"{r['unigram_own_perplexity']:.1f} | {r['slice_perplexity']:.4f} |"
        )
    if any(r["expert_loads"] for r in evaluation["sets"].values()):
        top_k = config.get("num_experts_per_tok")
        out += [
            "",
            "## Tokens per routed expert",
            "",
            f"(token, expert) assignments per routed expert per MoE layer (each token goes to "
            f"{top_k} experts), counted from the routers' top-k indices over non-overlapping "
            f"{w}-token windows of each evaluation set. A balanced router gives every expert "
            "mean load (min/mean = max/mean = 1).",
        ]
        for name, r in evaluation["sets"].items():
            out += ["", f"### {name}", ""] + expert_table(r["expert_loads"])
    return "\n".join(out) + "\n"


def write_card(model_dir: Path):
    (model_dir / "MODEL_CARD.md").write_text(card_text(model_dir))


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        write_card(Path(arg))
