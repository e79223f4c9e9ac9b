"""dsquant: quantize, serve and validate DeepSeek models."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`dsquant.LLM` and `dsquant.SamplingParams`, imported on first use so `import dsquant` stays light."""
    if name == "LLM":
        from dsquant.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dsquant.runtime.engine.sequence import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'dsquant' has no attribute {name!r}")
