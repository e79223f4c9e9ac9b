"""The peer of `dsquant bench engine`: transformers' generate on the same random V2-Lite-shaped model, BF16."""
from __future__ import annotations

import gc
import time

from dsquant.runtime.engine.timing import sync as _sync


def hf_peer(spec) -> list[dict]:
    """transformers' generate on the BF16 random model: tokens/s at each batch (input 512).
    spec: bench.engine.EngineBenchSpec (device, config, num_layers, input_len, peer_batches, peer_output)."""
    import torch
    import transformers

    from dsquant.bench.random_model import SHAPES

    cfg_dict = {**SHAPES[spec.model], **spec.config}
    if spec.num_layers:
        cfg_dict["num_hidden_layers"] = spec.num_layers
    cfg_dict.pop("architectures", None)
    config = transformers.DeepseekV2Config(**cfg_dict)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: no fp32 copy of 15.7B
    try:
        with torch.device(spec.device):
            model = transformers.DeepseekV2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    rows = []
    for b in spec.peer_batches:
        x = torch.randint(10, 32000 if config.vocab_size > 32000 else config.vocab_size, (b, spec.input_len),
                          device=spec.device)
        timings = {}
        for n in (1, spec.peer_output):
            model.generate(x, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
            _sync(spec.device)
            t = time.perf_counter()
            model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            _sync(spec.device)
            timings[n] = time.perf_counter() - t
        rows.append({"batch": b, "output_tokens": spec.peer_output, "wall_s": timings[spec.peer_output],
                     "output_tok_s": b * spec.peer_output / timings[spec.peer_output],
                     "decode_tok_s": b * (spec.peer_output - 1) / (timings[spec.peer_output] - timings[1])})
    del model
    gc.collect()
    if spec.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows
