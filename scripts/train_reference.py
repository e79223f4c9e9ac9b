"""Train dsquant's two bundled reference models on the training corpus (one H200, minutes).

    python scripts/train_reference.py --corpus .corpora/train.jsonl.xz --out dsquant/assets/models

dsq-tiny-v3     transformers' DeepseekV3ForCausalLM: MLA with q LoRA, YaRN RoPE, 16 routed
                experts (top-4 of 2 groups out of 4, sigmoid scores, noaux_tc) + 1 shared,
                first layer dense
dsq-tiny-qwen2  transformers' Qwen2ForCausalLM: GQA with q/k/v bias, tied embeddings

Recipe (both): sequences of 512 tokens drawn at seeded random offsets from the token stream of
train.jsonl.xz (BOS + document + EOS, documents in file order), bf16 autocast over fp32 master
weights, fused AdamW, linear warm-up then cosine decay to 10% of the peak rate, gradient
clipping at 1.0. The run length is a step count: given by --steps, or else chosen after a short
timed probe so the model fits its --minutes budget; training.json records the count used, so
`--steps N` reruns it (GPU kernels are not bitwise deterministic; the seed fixes init and data).

MoE load balancing is DeepSeek-V3's auxiliary-loss-free rule: a forward hook on each router
counts the experts in its top-k indices; after every optimizer step each layer's
e_score_correction_bias moves by gamma * sign(mean load - expert load). The bias only steers
which experts are chosen; the gate weights still come from the unbiased sigmoid scores.
"""
import argparse
import json
import lzma
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "dsquant" / "assets" / "tokenizer"


@dataclass
class TrainSettings:
    seed: int = 0
    seqlen: int = 512
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update_gamma: float = 1e-3  # DeepSeek-V3's bias update speed
    steps: int | None = None  # None: chosen from minutes after the probe
    max_steps: int = 4000
    minutes: float = 2.5
    probe_steps: int = 25
    log_every: int = 100


def v3_config(vocab_size: int, bos: int, eos: int) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        topk_method="noaux_tc", scoring_func="sigmoid",  # read by vLLM / SGLang; transformers implies them
        max_position_embeddings=2048, rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 512, "mscale": 1.0, "mscale_all_dim": 1.0,
            "beta_fast": 32.0, "beta_slow": 1.0,
        },
        tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos, num_nextn_predict_layers=0,
    )


def qwen2_config(vocab_size: int, bos: int, eos: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos, use_sliding_window=False,
    )


MODELS = {  # name: (config builder, model class, max shard size, default minutes of training)
    "dsq-tiny-v3": (v3_config, DeepseekV3ForCausalLM, "12MB", 2.5),
    "dsq-tiny-qwen2": (qwen2_config, Qwen2ForCausalLM, "15MB", 1.5),
}


def token_stream(corpus: Path, tokenizer) -> torch.Tensor:
    """All of train.jsonl.xz as one stream: BOS + document + EOS, documents in file order."""
    with lzma.open(corpus, "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    ids = tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]
    stream = [t for doc in ids for t in [tokenizer.bos_token_id, *doc, tokenizer.eos_token_id]]
    return torch.tensor(stream, dtype=torch.int32)


class ExpertLoadBalancer:
    """Counts each router's top-k choices (forward hooks) and applies the V3 bias update."""

    def __init__(self, model):
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        device = next(model.parameters()).device
        self.counts = [torch.zeros(r.num_experts, dtype=torch.float32, device=device) for r in self.routers]
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i):
        def count(module, inputs, output):
            topk_indices = output[2]  # [tokens, top_k]
            self.counts[i] += torch.bincount(topk_indices.flatten(), minlength=module.num_experts).float()
        return count

    @torch.no_grad()
    def update_bias(self, gamma: float):
        for router, load in zip(self.routers, self.counts):
            router.e_score_correction_bias += gamma * torch.sign(load.mean() - load)
            load.zero_()

    def imbalance(self) -> float:
        """max/mean expert load over the counts gathered since the last update (1.0 = balanced)."""
        return max((c.max() / c.mean().clamp(min=1)).item() for c in self.counts)

    def remove(self):
        for h in self.handles:
            h.remove()


def lr_at(step: int, total: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def loss_on(model, input_ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=input_ids, use_cache=False).logits  # [B, T, V]
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), input_ids[:, 1:].flatten())


def pick_experts_implementation(model, batch: torch.Tensor):
    """grouped_mm where this torch runs it on fp32 master weights under autocast, else eager."""
    if not any(hasattr(m, "e_score_correction_bias") for m in model.modules()):
        return "n/a"
    try:
        with torch.autocast(batch.device.type, dtype=torch.bfloat16):
            loss_on(model, batch[:2]).backward()
        choice = model.config._experts_implementation
    except (RuntimeError, NotImplementedError) as e:
        print(f"  grouped_mm failed ({type(e).__name__}: {str(e)[:120]}); using eager experts")
        model.set_experts_implementation("eager")
        choice = "eager"
    model.zero_grad(set_to_none=True)
    return choice


def train_model(name: str, stream: torch.Tensor, tokenizer, s: TrainSettings, out_dir: Path, device: str) -> dict:
    build_config, model_class, shard_size, _ = MODELS[name]
    torch.manual_seed(s.seed)
    config = build_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    model = model_class(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    data_gen = torch.Generator().manual_seed(s.seed + 1)
    positions = torch.arange(s.seqlen, device=device)

    def next_batch():
        starts = torch.randint(0, stream.numel() - s.seqlen, (s.batch_size,), generator=data_gen)
        return stream[starts.to(device)[:, None] + positions].long()  # [B, T]

    experts_impl = pick_experts_implementation(model, next_batch())
    balancer = ExpertLoadBalancer(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda",
    )
    total = s.steps or s.max_steps
    print(f"{name}: {n_params:,} parameters, experts={experts_impl}, device={device}", flush=True)
    model.train()
    start = time.time()
    probe_start, step, losses = None, 0, []
    while step < total:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total, s)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = loss_on(model, next_batch())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        logging = step % s.log_every == 0 or step == total
        imbalance = balancer.imbalance() if balancer.routers and logging else None
        balancer.update_bias(s.bias_update_gamma)
        losses.append(loss.detach())
        if step == 5:  # first steps pay for kernel selection; time the ones after
            _sync(device)
            probe_start = time.time()
        if s.steps is None and step == 5 + s.probe_steps:
            _sync(device)
            per_step = (time.time() - probe_start) / s.probe_steps
            budget_steps = int((s.minutes * 60 - (time.time() - start)) / per_step) + step
            total = max(s.warmup_steps + 1, min(s.max_steps, budget_steps))
            print(f"  {per_step * 1000:.1f} ms/step -> {total} steps", flush=True)
        if logging:
            recent = torch.stack(losses[-s.log_every:]).mean().item()
            extra = f" max/mean expert load {imbalance:.2f}" if imbalance is not None else ""
            print(f"  step {step}/{total} loss {recent:.3f} lr {lr_at(step - 1, total, s):.2e} "
                  f"{time.time() - start:.0f}s{extra}", flush=True)
    _sync(device)
    seconds = time.time() - start
    balancer.remove()
    final_loss = torch.stack(losses[-50:]).mean().item()
    save_checkpoint(model, out_dir / name, shard_size)
    stats = {
        "model": name, "architecture": model_class.__name__, "parameters": n_params,
        "steps": step, "tokens": step * s.batch_size * s.seqlen, "train_seconds": round(seconds, 1),
        "final_train_loss": round(final_loss, 4), "experts_implementation": experts_impl,
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__, "settings": asdict(s),
        "corpus_tokens": stream.numel(),
        "rerun": f"python scripts/train_reference.py --models {name} --steps {step} --seed {s.seed}",
    }
    (out_dir / name / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def save_checkpoint(model, path: Path, shard_size: str):
    """bf16 safetensors shards + config; the V3 correction bias stays fp32 (it is a tiny buffer
    whose small steps bf16 would round away)."""
    biases = {n: b.detach().float().cpu().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    model = model.to("cpu", torch.bfloat16)
    for name, bias in biases.items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        module.e_score_correction_bias = bias
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path, max_shard_size=shard_size)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copyfile(f, path / f.name)


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=Path(".corpora/train.jsonl.xz"))
    parser.add_argument("--out", type=Path, default=Path("dsquant/assets/models"))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=None, help="fixed step count (default: fit --minutes)")
    parser.add_argument("--minutes", type=float, default=None, help="budget per model (default: per model)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    tokenizer = PreTrainedTokenizerFast.from_pretrained(TOKENIZER_DIR)  # tokenizer.json as written
    t0 = time.time()
    stream = token_stream(args.corpus, tokenizer).to(args.device)
    print(f"corpus: {stream.numel():,} tokens ({time.time() - t0:.1f}s)", flush=True)
    for name in args.models:
        minutes = args.minutes if args.minutes is not None else MODELS[name][3]
        settings = TrainSettings(seed=args.seed, steps=args.steps, minutes=minutes, batch_size=args.batch_size)
        stats = train_model(name, stream, tokenizer, settings, args.out, args.device)
        print(json.dumps({k: stats[k] for k in ("model", "steps", "tokens", "train_seconds", "final_train_loss")}), flush=True)


if __name__ == "__main__":
    main()
