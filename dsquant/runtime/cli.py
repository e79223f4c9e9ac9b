"""`dsquant generate`: one prompt through the runtime engine, the generated text on stdout.

The prompt comes from --prompt TEXT, --prompt - (stdin) or --prompt-file PATH. --chat (implied by
--system) renders it as a user message, after the system message if any, with the chat template
(--chat-template, else the tokenizer's) before tokenizing.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from dsquant.cli_options import chat_template, engine_config, engine_options, pop_engine_options
from dsquant.errors import DsquantError


def _read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give the prompt as --prompt TEXT, --prompt - (stdin) or --prompt-file PATH "
                               "(exactly one)")
    if prompt_file is not None:
        try:
            return Path(prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DsquantError(f"--prompt-file {prompt_file}: cannot be read ({e})") from None
    return sys.stdin.read() if prompt == "-" else prompt


@click.command(short_help="Generate text from a checkpoint, artifact or bundled model.")
@click.argument("artifact", type=str)
@click.option("--prompt", default=None, help="Prompt text; '-' reads it from stdin.")
@click.option("--prompt-file", default=None, type=click.Path(dir_okay=False, path_type=str),
              help="Read the prompt from this file.")
@click.option("--chat", is_flag=True, help="Apply the chat template: the prompt is a user message.")
@click.option("--system", default=None, help="System message (implies --chat).")
@click.option("--stop", multiple=True, help="Stop before this text; repeatable.")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="Tokens to generate at most.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="0 means greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True),
              help="Nucleus sampling: keep the most likely tokens up to this probability mass.")
@click.option("--top-k", default=0, show_default=True, type=int, help="Keep the K most likely tokens; 0 means off.")
@engine_options
def generate(artifact: str, prompt: str | None, prompt_file: str | None, chat: bool, system: str | None,
             stop: tuple[str, ...], max_tokens: int, temperature: float, top_p: float, top_k: int,
             **engine_opts) -> None:
    """Generate text from ARTIFACT (a checkpoint or artifact directory, or a bundled model name)."""
    from dsquant.assets import resolve_model_dir
    from dsquant.runtime.engine.sequence import SamplingParams
    from dsquant.runtime.llm import LLM

    opts = pop_engine_options(engine_opts)
    text = _read_prompt(prompt, prompt_file)
    model_dir = resolve_model_dir(artifact)
    chat = chat or system is not None
    template = None
    if chat:
        template = chat_template(opts["chat_template"], opts["tokenizer"] or model_dir)
        if template is None:
            raise DsquantError(f"--chat: {opts['tokenizer'] or model_dir} has no chat template "
                               "(tokenizer_config.json chat_template or chat_template.jinja); give --chat-template")
    elif opts["chat_template"] is not None:
        raise click.UsageError("--chat-template needs --chat (or --system)")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=opts["seed"], stop=list(stop))
    with LLM(model_dir, engine_config(opts, max_num_seqs=1)) as llm:
        if template is not None:
            if llm.engine.tokenizer is None:
                raise DsquantError(f"--chat: {model_dir} has no tokenizer.json; give --tokenizer DIR")
            messages = ([{"role": "system", "content": system}] if system is not None else []) + \
                [{"role": "user", "content": text}]
            # the template writes BOS itself
            prompt_in = llm.engine.tokenizer.encode(template.render(messages), add_special_tokens=False).ids
        else:
            prompt_in = text
        out = llm.generate(prompt_in, params)[0]
    click.echo(out.text)
