"""Paged attention: GQA decode and prefill, MLA decode, the split-KV merge, KV-cache stores (bf16 and FP8), torch references."""
