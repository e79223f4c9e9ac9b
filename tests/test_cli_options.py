"""vLLM-spelled serve/generate flags, the shared engine options and CLI polish (CPU, bundled models)."""
import logging
import shutil

import click
import pytest
import torch
from click.testing import CliRunner

from dsquant.assets import tokenizer_path
from dsquant.cli import cli, main
from dsquant.errors import DsquantError


class Loaded(Exception):
    """Raised by the fake engine: the flags got as far as an EngineConfig."""


def run_main(capsys, args):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


@pytest.fixture
def fake_engine(monkeypatch):
    import dsquant.runtime.engine.llm_engine as llm_engine
    import dsquant.runtime.llm as llm  # before the patch, or it would import the fake as its LLMEngine

    seen = {}

    def fake(path, config=None, reader=None):
        seen["path"], seen["config"] = str(path), config
        raise DsquantError("loaded")

    monkeypatch.setattr(llm_engine, "LLMEngine", fake)
    monkeypatch.setattr(llm, "LLMEngine", fake)  # generate's LLM
    return seen


def test_serve_flags_map_to_the_engine_config(fake_engine, capsys):
    code, _, err = run_main(capsys, [
        "serve", "dsq-tiny-qwen2", "--port", "0", "--device", "cpu", "--dtype", "float16", "--enforce-eager",
        "--no-enable-prefix-caching", "--max-num-batched-tokens", "512", "--seed", "7", "-tp", "2",
        "--max-model-len", "128", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "3",
        "--tokenizer", str(tokenizer_path()), "--kv-cache-dtype", "auto", "--no-async-scheduling"])
    assert code == 2 and "loaded" in err, err
    c = fake_engine["config"]
    assert (c.device, c.dtype, c.enforce_eager, c.enable_prefix_caching) == ("cpu", torch.float16, True, False)
    assert (c.max_num_batched_tokens, c.seed, c.tensor_parallel_size, c.max_model_len) == (512, 7, 2, 128)
    assert (c.gpu_memory_utilization, c.max_num_seqs, c.async_scheduling) == (0.5, 3, False)
    assert c.tokenizer == str(tokenizer_path())
    assert fake_engine["path"].endswith("dsq-tiny-qwen2")


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize("value, expected", [("fp8", "fp8"), ("fp8_e4m3", "fp8"), ("auto", "auto")])
def test_kv_cache_dtype_reaches_the_engine_config(fake_engine, capsys, command, value, expected):
    extra = ["--port", "0"] if command == "serve" else ["--prompt", "hi"]
    code, _, err = run_main(capsys, [command, "dsq-tiny-qwen2", "--device", "cpu", *extra, "--kv-cache-dtype", value])
    assert code == 2 and "loaded" in err, err
    assert fake_engine["config"].kv_cache_dtype == expected


def test_old_option_names_still_work(fake_engine, capsys):
    code, _, _ = run_main(capsys, ["serve", "dsq-tiny-qwen2", "--port", "0", "--device", "cpu",
                                   "--tensor-parallel-size", "2", "--dtype", "half"])
    assert code == 2 and fake_engine["config"].tensor_parallel_size == 2
    assert fake_engine["config"].dtype == torch.float16


@pytest.mark.parametrize("args, message", [
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype 'int8': expected auto (the model dtype) or fp8"),
    (["--kv-cache-dtype", "fp8_e5m2"], "dsquant's FP8 cache is e4m3"),
    (["--chat-template", "missing.jinja"], "--chat-template missing.jinja: no such file"),
    (["--chat-template", "{% if %}"], "--chat-template: not a valid Jinja template"),
    (["--tokenizer", "/nonexistent"], "--tokenizer /nonexistent: expected a directory holding tokenizer.json"),
])
def test_serve_flag_errors_are_one_line_before_loading(fake_engine, capsys, args, message):
    code, _, err = run_main(capsys, ["serve", "dsq-tiny-qwen2", "--port", "0", "--device", "cpu", *args])
    assert code == 2 and "config" not in fake_engine, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_vllm_api_key_is_accepted(monkeypatch):
    from dsquant.runtime.server.cli_serve import _api_key

    monkeypatch.delenv("DSQUANT_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "k1")
    assert _api_key(None) == "k1"
    monkeypatch.setenv("DSQUANT_API_KEY", "k2")
    assert _api_key(None) == "k2"  # dsquant's own name wins
    monkeypatch.delenv("DSQUANT_API_KEY")
    monkeypatch.setenv("VLLM_API_KEY", " ")
    with pytest.raises(DsquantError, match="empty"):
        _api_key(None)


@pytest.mark.parametrize("disable", [False, True])
def test_serve_chat_template_tokenizer_and_request_log(monkeypatch, capsys, caplog, tmp_path, disable):
    from fastapi.testclient import TestClient

    import dsquant.runtime.server.cli_serve as cli_serve

    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_path(), tok)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    seen = {}

    class FakeServer:
        def run(self, sockets):
            s = seen["app"].state.server
            seen["rendered"] = s.prompts.render_chat([{"role": "user", "content": "hi"}])
            seen["tokenizer"] = str(s.prompts.path)
            with TestClient(seen["app"]) as client:
                r = client.post("/v1/completions", json={"prompt": "secret words", "max_tokens": 2})
                seen["status"] = r.status_code

    def build(app, shutdown_timeout=30.0, log_level="warning"):
        seen["app"] = app
        return FakeServer()

    monkeypatch.setattr(cli_serve, "build_server", build)
    logger = logging.getLogger("dsquant.server")
    level = logger.level
    try:
        code, _, err = run_main(capsys, [
            "serve", "dsq-tiny-qwen2", "--port", "0", "--device", "cpu", "--max-model-len", "64",
            "--max-num-seqs", "1", "--allowed-hosts", "*", "--tokenizer", str(tok), "--chat-template",
            str(template), *(["--disable-log-requests"] if disable else [])])
    finally:
        logger.setLevel(level)
    assert code == 0, err
    assert seen["rendered"] == "[hi]" and seen["tokenizer"] == str(tok) and seen["status"] == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "dsquant.server" and "tokens in" in r.getMessage()]
    assert len(lines) == (0 if disable else 1), lines
    assert "secret" not in caplog.text


@pytest.fixture
def fake_llm(monkeypatch):
    """generate against a stand-in LLM: records the prompt, the sampling params and the config."""
    import dsquant.runtime.llm as llm_mod
    from dsquant.data.tokenizer import backend_tokenizer

    seen = {}

    class Out:
        text = "out"

    class FakeLLM:
        def __init__(self, path, config):
            seen["path"], seen["config"] = str(path), config
            self.engine = type("E", (), {"tokenizer": backend_tokenizer(tokenizer_path())})()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def generate(self, prompt, params):
            seen["prompt"], seen["params"] = prompt, params
            return [Out()]

    monkeypatch.setattr(llm_mod, "LLM", FakeLLM)
    return seen


def test_generate_prompt_sources(fake_llm, tmp_path):
    runner = CliRunner()
    base = ["generate", "dsq-tiny-qwen2", "--device", "cpu"]
    r = runner.invoke(cli, [*base, "--prompt", "-", "--stop", "a", "--stop", "b", "--seed", "3"], input="from stdin")
    assert r.exit_code == 0 and r.output == "out\n", r.output
    assert fake_llm["prompt"] == "from stdin" and fake_llm["params"].stop == ["a", "b"]
    assert fake_llm["params"].seed == 3 and fake_llm["config"].seed == 3 and fake_llm["config"].max_num_seqs == 1
    f = tmp_path / "p.txt"
    f.write_text("from a file")
    assert runner.invoke(cli, [*base, "--prompt-file", str(f), "--enforce-eager"]).exit_code == 0
    assert fake_llm["prompt"] == "from a file" and fake_llm["config"].enforce_eager
    r = runner.invoke(cli, [*base])
    assert r.exit_code == 2 and "--prompt-file" in r.output


def test_generate_chat_renders_the_template(fake_llm):
    from dsquant.data.tokenizer import backend_tokenizer

    r = CliRunner().invoke(cli, ["generate", "dsq-tiny-qwen2", "--device", "cpu", "--prompt", "Hello",
                                 "--system", "Be brief."])
    assert r.exit_code == 0, r.output
    text = backend_tokenizer(tokenizer_path()).decode(fake_llm["prompt"], skip_special_tokens=False)
    assert text.startswith("<｜begin▁of▁sentence｜>Be brief.\n<｜User｜>Hello<｜Assistant｜>"), text
    r = CliRunner().invoke(cli, ["generate", "dsq-tiny-qwen2", "--device", "cpu", "--prompt", "Hello", "--chat",
                                 "--chat-template", "{{ messages[0]['content'] }}!"])
    assert r.exit_code == 0
    assert backend_tokenizer(tokenizer_path()).decode(fake_llm["prompt"]) == "Hello!"


def test_generate_stop_on_the_real_engine():
    runner = CliRunner()
    base = ["generate", "dsq-tiny-qwen2", "--device", "cpu", "--prompt", "Once upon a time", "--max-tokens", "12",
            "--max-model-len", "64"]
    full = runner.invoke(cli, base)
    assert full.exit_code == 0, full.output
    words = full.output.split()
    assert len(words) >= 3, full.output
    stopped = runner.invoke(cli, [*base, "--stop", words[2]])
    assert stopped.exit_code == 0
    assert stopped.output.rstrip("\n") == full.output[:full.output.index(words[2])]


@pytest.mark.parametrize("args", [
    ["generate", "dsq-tiny-qwen2", "--prompt", "x"],
    ["serve", "dsq-tiny-qwen2", "--port", "0"],
    ["quantize", "dsq-tiny-qwen2", "--scheme", "W4A16", "-o", "unused"],
    ["validate", "dsq-tiny-qwen2", "--baseline", "dsq-tiny-qwen2"],
    ["demo"],
])
def test_device_cuda_without_a_gpu_is_one_line_exit_2(monkeypatch, capsys, args):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run_main(capsys, [*args, "--device", "cuda"])
    assert code == 2, err
    assert err.strip() == "error: --device cuda: no CUDA device is available (use --device cpu)"


def test_a_mistyped_bundled_name_lists_the_bundled_ones(capsys):
    code, _, err = run_main(capsys, ["inspect", "dsq-tiny-v4"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "dsq-tiny-v3, dsq-tiny-qwen2" in err and "did you mean dsq-tiny-v3?" in err


def _commands(cmd, prefix=()):
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, (*prefix, name))
    else:
        yield prefix, cmd


PENDING: set = set()  # commands still to get a whole short_help and the shared --device


def test_help_summaries_are_whole_and_every_option_has_help():
    for path, cmd in _commands(cli):
        if path in PENDING:
            continue
        assert not cmd.get_short_help_str(limit=45).endswith("..."), path
        for p in cmd.params:
            if isinstance(p, click.Option):
                assert p.help, (path, p.opts)


def test_generate_and_serve_declare_each_engine_option_once():
    """serve and generate take the engine options from one list (cli_options.engine_options): the same
    flags, types, defaults and help; bench serve's --max-model-len / --max-num-seqs match serve's."""
    from dsquant.cli_options import ENGINE_KEYS

    def options(cmd, names):
        info = {p.name: p.to_info_dict() for p in cmd.params if isinstance(p, click.Option)}
        return {n: info[n] for n in names}

    generate, serve = cli.commands["generate"], cli.commands["serve"]
    bench_serve = cli.commands["bench"].commands["serve"]
    assert options(generate, ENGINE_KEYS) == options(serve, ENGINE_KEYS)
    for name in ("max_model_len", "max_num_seqs"):
        mine, theirs = options(bench_serve, [name])[name], options(serve, [name])[name]
        assert {**mine, "help": None} == {**theirs, "help": None}, name
