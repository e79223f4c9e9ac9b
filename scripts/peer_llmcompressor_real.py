"""Peer run for issue 20: llm-compressor on SmolLM2-135M with dsquant's own calibration tokens.

Runs inside llm-compressor's own virtualenv (python3.11 -m venv /tmp/lc-venv && /tmp/lc-venv/bin/pip
install llmcompressor: 0.14.0.1 pins torch <= 2.14.0), never in dsquant's; imports nothing of dsquant.
The token ids are dsquant's calibration draw (bundled set, n=32, seqlen=512, seed 0), exported from
dsquant's environment as a safetensors int64 tensor "input_ids" [32, 512]:

    python -c "import sys; from safetensors.torch import save_file; from dsquant.data import calibration_samples;
    from dsquant.data.tokenizer import load_tokenizer; save_file({'input_ids': calibration_samples(
    load_tokenizer(sys.argv[1]), 32, 512, 0).contiguous()}, sys.argv[2])" $M calib_ids.safetensors

    OMP_NUM_THREADS=2 /tmp/lc-venv/bin/python scripts/peer_llmcompressor_real.py gptq --model $M --tokens T --out OUT
    OMP_NUM_THREADS=2 /tmp/lc-venv/bin/python scripts/peer_llmcompressor_real.py fp8-block --model $M --out OUT
    OMP_NUM_THREADS=2 /tmp/lc-venv/bin/python scripts/peer_llmcompressor_real.py awq --model $M --tokens T --out OUT [--layers 2]
        [--group-size 128 --mixed-moe]   # dsq-tiny-v3: dense layer 0, MoE after it

then `dsquant validate --baseline $M OUT ...` scores the compressed-tensors artifacts it writes.
"""
import argparse
import json
import os
import time

import torch


def dataset(tokens: str):
    from datasets import Dataset
    from safetensors.torch import load_file

    ids = load_file(tokens)["input_ids"]  # [n, seqlen] int64
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    return ds, ids.shape


def int4_group(symmetric: bool, group_size: int) -> dict:
    return {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                        "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric,
                                    "strategy": "group", "group_size": group_size}}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("algo", choices=["gptq", "fp8-block", "awq"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens")
    ap.add_argument("--out", required=True)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N decoder layers (timing)")
    ap.add_argument("--mixed-moe", action="store_true",
                    help="AWQ: llm-compressor's mappings for DeepSeek-style models whose first layers are dense "
                         "(its DeepseekV3 mappings name the router, which the dense layers lack)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    if not torch.accelerator.is_available():
        # AWQ pins its cached activations (for fast H2D copies); without a driver torch refuses to.
        torch.Tensor.pin_memory = lambda self, *a, **k: self

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.layers:
        model.model.layers = model.model.layers[: args.layers]
        model.config.num_hidden_layers = args.layers
    ignore = ["lm_head"]
    kw = {}
    if args.algo == "gptq":
        recipe = GPTQModifier(targets=["Linear"], ignore=ignore, config_groups=int4_group(True, args.group_size))
    elif args.algo == "fp8-block":
        recipe = QuantizationModifier(targets=["Linear"], scheme="FP8_BLOCK", ignore=ignore)
    else:
        mappings = None
        if args.mixed_moe:
            from llmcompressor.modifiers.transform.awq.mappings import AWQ_MAPPING_REGISTRY
            mappings = AWQ_MAPPING_REGISTRY["DeepseekV2ForCausalLM"]
        recipe = [AWQModifier(duo_scaling=True, n_grid=20, mappings=mappings),
                  QuantizationModifier(targets=["Linear"], ignore=ignore,
                                       config_groups=int4_group(False, args.group_size))]
    if args.algo != "fp8-block":
        ds, shape = dataset(args.tokens)
        kw = dict(dataset=ds, max_seq_length=shape[1], num_calibration_samples=shape[0],
                  shuffle_calibration_samples=False)
    t0 = time.time()
    oneshot(model=model, recipe=recipe, **kw)
    took = time.time() - t0
    print(f"PEER {args.algo} oneshot took {took:.1f} s (threads {torch.get_num_threads()})", flush=True)
    t1 = time.time()
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    print(f"PEER save took {time.time() - t1:.1f} s", flush=True)
    with open(os.path.join(args.out, "peer_run.json"), "w") as f:
        json.dump({"algo": args.algo, "oneshot_s": round(took, 1), "threads": torch.get_num_threads(),
                   "layers": args.layers or model.config.num_hidden_layers}, f)


if __name__ == "__main__":
    main()
