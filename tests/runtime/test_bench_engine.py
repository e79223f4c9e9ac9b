"""`dsquant bench engine` on CPU with a tiny V2-Lite-shaped config: both steppings measured, the
JSON and the table written, bad options refused."""
import json

from click.testing import CliRunner

from dsquant.bench.engine import engine

TINY = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "max_position_embeddings": 4096, "rope_scaling": None}
ARGS = ["--device", "cpu", "--layers", "2", "--schemes", "bf16", "--input-len", "16", "--batch1-output", "6",
        "--concurrency", "3", "--concurrent-output", "5", "--peer-batches=", "--config-json", json.dumps(TINY)]


def test_bench_engine_measures_sync_and_async_stepping(tmp_path):
    out = tmp_path / "engine.json"
    res = CliRunner().invoke(engine, ARGS + ["--json", str(out)])
    assert res.exit_code == 0, res.output
    row = json.loads(out.read_text())["schemes"]["bf16"]
    for key in ("batch1", "batch1_async"):
        assert row[key]["output_tokens"] == 6 and row[key]["decode_tok_s"] > 0
    for key in ("concurrent", "concurrent_async"):
        assert row[key]["output_tokens"] == 3 * 5 and row[key]["output_tok_s"] > 0
    assert "| bf16 | sync |" in res.output and "| bf16 | async |" in res.output


def test_bench_engine_multi_step(tmp_path):
    """--num-scheduler-steps: the engine decodes in bursts; time per output token is each request's mean
    (a burst's tokens arrive together, so the median gap would be zero)."""
    out = tmp_path / "engine.json"
    res = CliRunner().invoke(engine, ARGS + ["--modes", "async", "--num-scheduler-steps", "4", "--json", str(out)])
    assert res.exit_code == 0, res.output
    row = json.loads(out.read_text())["schemes"]["bf16"]
    assert row["batch1_async"]["output_tokens"] == 6 and row["batch1_async"]["tpot_ms"] > 0
    assert row["concurrent_async"]["output_tokens"] == 3 * 5


def test_bench_engine_refuses_an_unknown_mode():
    res = CliRunner().invoke(engine, ARGS + ["--modes", "sync,fast"])
    assert res.exit_code != 0 and "--modes" in res.output


def test_bench_engine_long_prompt_beside_short_streams(tmp_path):
    """A 40-token prompt in chunks of 16 tokens, alone and beside 2 short decoding streams: its TTFT,
    and the streams' times between tokens during its prefill and alone."""
    out = tmp_path / "engine.json"
    args = [a for a in ARGS]
    args[args.index("--concurrency") + 1] = "0"
    res = CliRunner().invoke(engine, args + ["--modes", "sync", "--long-context", "40", "--long-streams", "2",
                                             "--max-num-batched-tokens", "16", "--long-prefill-token-threshold",
                                             "0,4", "--json", str(out)])
    assert res.exit_code == 0, res.output
    long = json.loads(out.read_text())["schemes"]["bf16"]["long_context"]
    assert long["prompt_tokens"] == 40 and long["ttft_s"] > 0 and long["max_num_batched_tokens"] == 16
    beside = long["beside_streams"]
    assert beside["streams"] == 2 and beside["long_ttft_s"] > 0
    assert beside["alone"]["gaps"] > 0 and beside["alone"]["median_ms"] > 0
    # 40 tokens in 16-token steps, two of them taken by the streams' decodes: at least 2 steps of prefill
    assert beside["during_prefill"]["gaps"] >= 2 and beside["during_prefill"]["median_ms"] > 0
    capped = long["beside_by_threshold"][1]
    assert long["beside_by_threshold"][0] == beside and capped["long_prefill_token_threshold"] == 4
    # every chunk capped at 4 (the streams' 16-token prompts too): 10 steps of long prefill, the last 6
    # of them beside the streams' decodes, so at least 5 gaps per stream end before its first token
    assert capped["during_prefill"]["gaps"] >= 2 * 5 > beside["during_prefill"]["gaps"]


def test_bench_engine_tensor_parallel_against_tp1(tmp_path):
    """--tensor-parallel-size 1,2 on CPU (gloo): every rank makes its shard of the random model on its
    own (RandomReaderSpec), both sizes are measured, and the TP=2 row carries the all-reduce time of a
    batch-1 request (two per decoder layer and token, plus the embedding's) and its comparison table.
    (That the shards are slices of the TP=1 model: test_tensor_parallel_random_reader_equals_tp1.)"""
    out = tmp_path / "engine.json"
    res = CliRunner().invoke(engine, ARGS + ["--schemes", "bf16,fp8", "--modes", "sync",
                                             "--tensor-parallel-size", "1,2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["schemes"]
    for scheme in ("bf16", "fp8"):
        one, two = rows[scheme], rows[f"{scheme}-tp2"]
        assert one["tensor_parallel_size"] == 1 and two["tensor_parallel_size"] == 2
        assert two["batch1"]["output_tokens"] == 6 and two["concurrent"]["output_tokens"] == 15
        ar = two["allreduce"]
        assert ar["output_tokens"] == 32 and ar["allreduce_ms_per_token"] > 0 and 0 < ar["allreduce_share"] < 1
        # 2 layers x (attention + MLP) + the vocab-parallel embedding, per step (one token per step)
        assert ar["calls_per_token"] >= 5
        assert "allreduce" not in one
    assert "| bf16-tp2 | sync |" in res.output and "| fp8-tp2 | sync |" in res.output


def test_bench_engine_refuses_a_bad_tensor_parallel_size():
    res = CliRunner().invoke(engine, ARGS + ["--tensor-parallel-size", "0"])
    assert res.exit_code != 0 and "--tensor-parallel-size" in res.output
