"""Evaluate a bundled reference model and write its MODEL_CARD.md (and eval.json) beside it.

    python scripts/eval_reference.py dsquant/assets/models/dsq-tiny-v3 --corpus .corpora/train.jsonl.xz

Runs the checkpoint in float32 through transformers (TF32 off). Figures:
  perplexity     sliding windows of WINDOW tokens every STRIDE tokens over the whole of
                 eval_prose and eval_code (dsquant.data.sliding_window_perplexity), and over the
                 fixed slice the tests recompute on CPU (the first SLICE_TOKENS tokens)
  unigram        the same scored tokens under (a) a unigram model fit on the training stream
                 with add-one smoothing and (b) the evaluated text's own token frequencies,
                 the best any unigram model can do on it
  expert load    for MoE models: token-to-expert assignments per routed expert per MoE layer,
                 counted from the routers' top-k indices over non-overlapping WINDOW-token
                 windows of each evaluation set
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dsquant.data import eval_tokens, load_tokenizer, sliding_window_perplexity  # noqa: E402
from scripts.model_card import write_card  # noqa: E402
from scripts.train_reference import token_stream  # noqa: E402

WINDOW, STRIDE, SLICE_TOKENS = 512, 256, 2048
EVAL_SETS = ("eval_prose", "eval_code")


def unigram_perplexities(targets: torch.Tensor, train_counts: torch.Tensor) -> tuple[float, float]:
    """(train-fit add-one unigram, the text's own unigram) perplexity of `targets` [N]."""
    vocab = train_counts.numel()
    train_logp = torch.log((train_counts + 1) / (train_counts.sum() + vocab))
    own = torch.bincount(targets, minlength=vocab).double()
    own_logp = torch.log(own.clamp(min=1) / own.sum())
    n = targets.numel()
    return math.exp(-train_logp[targets].sum().item() / n), math.exp(-own_logp[targets].sum().item() / n)


@torch.no_grad()
def expert_loads(model, tokens: torch.Tensor, device: str, batch_size: int) -> dict[str, list[int]]:
    """Per MoE layer, the number of (token, expert) assignments each routed expert received."""
    counts, handles = {}, []
    for name, module in model.named_modules():
        if hasattr(module, "e_score_correction_bias"):
            layer = name.split(".layers.")[1].split(".")[0]
            counts[layer] = torch.zeros(module.num_experts, dtype=torch.long)

            def hook(mod, inputs, output, layer=layer):
                counts[layer] += torch.bincount(output[2].flatten().cpu(), minlength=mod.num_experts)

            handles.append(module.register_forward_hook(hook))
    if not counts:
        return {}
    n = tokens.numel() // WINDOW
    windows = tokens[: n * WINDOW].view(n, WINDOW)
    for i in range(0, n, batch_size):
        model(input_ids=windows[i : i + batch_size].to(device), use_cache=False)
    for h in handles:
        h.remove()
    return {layer: c.tolist() for layer, c in counts.items()}


def evaluate(model_dir: Path, corpus: Path, device: str, batch_size: int, max_tokens: int | None) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tokenizer = load_tokenizer(model_dir)  # not AutoTokenizer: see dsquant/data/tokenizer.py
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    if getattr(model.config, "n_routed_experts", None):
        model.set_experts_implementation("eager")  # the plain per-expert loop: exact fp32 on any device

    def logits_fn(input_ids):
        return model(input_ids=input_ids.to(device), use_cache=False).logits

    train = token_stream(corpus, tokenizer).long()
    train_counts = torch.bincount(train, minlength=len(tokenizer)).double()
    results = {"window": WINDOW, "stride": STRIDE, "slice_tokens": SLICE_TOKENS, "sets": {}}
    for name in EVAL_SETS:
        tokens = eval_tokens(tokenizer, name, max_tokens=max_tokens)
        full = sliding_window_perplexity(logits_fn, tokens, WINDOW, STRIDE, batch_size)
        sliced = sliding_window_perplexity(logits_fn, tokens[:SLICE_TOKENS], WINDOW, STRIDE, batch_size)
        unigram_train, unigram_own = unigram_perplexities(tokens[1:], train_counts)
        results["sets"][name] = {
            "tokens": tokens.numel(),
            "scored": full.n_scored,
            "perplexity": full.value,
            "slice_perplexity": sliced.value,
            "unigram_train_perplexity": unigram_train,
            "unigram_own_perplexity": unigram_own,
            "expert_loads": expert_loads(model, tokens, device, batch_size),
        }
        print(f"{model_dir.name} {name}: ppl {full.value:.3f} (slice {sliced.value:.4f}), unigram "
              f"{unigram_train:.1f} train-fit / {unigram_own:.1f} own", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dirs", type=Path, nargs="+")
    parser.add_argument("--corpus", type=Path, default=Path(".corpora/train.jsonl.xz"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=None, help="truncate each set (rehearsals only)")
    args = parser.parse_args()
    for model_dir in args.model_dirs:
        results = evaluate(model_dir, args.corpus, args.device, args.batch_size, args.max_tokens)
        results["device"] = torch.cuda.get_device_name() if args.device == "cuda" else args.device
        (model_dir / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
        write_card(model_dir)


if __name__ == "__main__":
    main()
