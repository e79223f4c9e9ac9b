"""Checkpoint converters from other formats into the HF layout dsquant loads (GGUF: convert.gguf)."""
