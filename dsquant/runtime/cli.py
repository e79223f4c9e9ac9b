"""`dsquant generate`: one prompt through the runtime engine, the generated text on stdout."""
from __future__ import annotations

import click


@click.command()
@click.argument("artifact", type=str)
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="0 means greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=int, help="0 means off.")
@click.option("--seed", default=None, type=int)
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="Default: cuda when available.")
@click.option("--max-model-len", default=None, type=int)
@click.option("--tensor-parallel-size", default=1, show_default=True, type=click.IntRange(min=1),
              help="Processes to split the model over: one per GPU on cuda, gloo processes on cpu.")
@click.option("--async-scheduling/--no-async-scheduling", default=True, show_default=True,
              help="Launch each engine step before reading the previous one's tokens.")
def generate(artifact: str, prompt: str, max_tokens: int, temperature: float, top_p: float, top_k: int,
             seed: int | None, device: str | None, max_model_len: int | None, tensor_parallel_size: int,
             async_scheduling: bool) -> None:
    """Generate text from ARTIFACT (a checkpoint or artifact directory, or a bundled model name)."""
    from dsquant.runtime.engine.llm_engine import EngineConfig
    from dsquant.runtime.engine.sequence import SamplingParams
    from dsquant.runtime.llm import LLM

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    with LLM(artifact, EngineConfig(device=device, max_num_seqs=1, max_model_len=max_model_len,
                                    tensor_parallel_size=tensor_parallel_size,
                                    async_scheduling=async_scheduling)) as llm:
        out = llm.generate(prompt, params)[0]
    click.echo(out.text)
