"""Peer run: llm-compressor's AWQ (W4A16 asymmetric, group 128) on the same model and tokens.

Runs in llm-compressor's own virtualenv (it pins other torch/compressed-tensors versions), so it
imports nothing of dsquant. The calibration tokens come from dsquant (`--tokens`, a safetensors
file with "input_ids" [n, seqlen], written by scripts/compare_peer_awq.py), so both tools
calibrate on identical data. Writes a compressed-tensors artifact that dsquant loads.

    /opt/llmc-venv/bin/python scripts/peer_llmcompressor.py --model DIR --tokens calib.safetensors --out OUT
"""
import argparse
import time

import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    if not torch.cuda.is_available():
        # llm-compressor pins its activation cache, which torch refuses without an accelerator;
        # on a CPU-only machine pinning is meaningless, so make it a no-op in this process.
        torch.Tensor.pin_memory = lambda self, *a, **k: self
    ids = load_file(args.tokens)["input_ids"]  # [n, seqlen]
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ignore = ["lm_head", "re:.*mlp.gate$"]
    recipe = [AWQModifier(duo_scaling=True, n_grid=20),
              QuantizationModifier(targets=["Linear"], scheme="W4A16_ASYM", ignore=ignore)]
    t0 = time.time()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=ids.shape[1],
            num_calibration_samples=ids.shape[0])
    print(f"llm-compressor AWQ took {time.time() - t0:.1f} s")
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)


if __name__ == "__main__":
    main()
