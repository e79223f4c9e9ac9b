"""Text data: bundled calibration and evaluation sets, and user sources read offline.

Sits low in the import order: imports dsquant.errors only (and `datasets` lazily, for parquet
and saved-dataset sources).
"""
from dsquant.data.calibration import calibration_samples
from dsquant.data.evaluation import EvalWindow, Perplexity, eval_tokens, sliding_window_perplexity, sliding_windows
from dsquant.data.sources import ACCEPTED_KINDS, BUNDLED_SETS, EVAL_SETS, bundled_path, load_documents
from dsquant.data.tokenizer import backend_tokenizer, load_tokenizer

__all__ = [
    "ACCEPTED_KINDS",
    "BUNDLED_SETS",
    "EVAL_SETS",
    "EvalWindow",
    "Perplexity",
    "backend_tokenizer",
    "bundled_path",
    "calibration_samples",
    "eval_tokens",
    "load_documents",
    "load_tokenizer",
    "sliding_window_perplexity",
    "sliding_windows",
]
