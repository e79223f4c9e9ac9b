"""Trained weights through the GPU serving path, against the CPU reference path (issue 17, item 3).

Cases: both bundled models (dsq-tiny-v3, dsq-tiny-qwen2) x {the BF16 checkpoint itself, every
bundled recipe quantized here on the CPU, two compressed-tensors artifacts laid out as
llm-compressor writes them (W4A16 pack-quantized and FP8_BLOCK float-quantized, built with
compressed_tensors in llmc_artifacts.py)}.

  CPU reference path   validate.runner._runtime_model(path, "cpu"): float32, pure torch (each
                       quantized Linear dequantized once; FP8 W8A8 rounds activations in torch)
  GPU serving path     _runtime_model(path, "cuda"): bf16, the Triton quantized GEMMs, fused MoE
  GPU engine           LLMEngine on CUDA: CUDA graphs on (enforce_eager=False), Triton paged
                       attention, fused ops, async scheduling: decode runs the GEMV kernels
  CPU reference engine LLMEngine on the CPU, float32, kernels off

The GPU test (marked gpu) holds the issue's thresholds, perplexity within 0.5% of the CPU
reference's and top-1 agreement of the logits >= 0.98 (same windows of held-out prose), or, where a
figure misses one, holds it to the bf16 floor: the CPU pure-torch path run in bf16 against the same
float32 reference, no GPU kernel involved. bf16 rounding alone misses 0.98 (H200, 4096 tokens:
floor top-1 0.918-0.978, FP8 W8A8 lowest, its activation re-quantization amplifying the rounding),
so a figure near the floor is rounding and one far beyond it is a kernel. Mean KL to the reference
is always held to 2 x the floor's. Greedy: the engine's tokens equal the CPU reference engine's on
at least the first 8 of 16 for every prompt, unless the bf16 reference engine diverges there too or
the first difference, from the reference or from the bf16 engine, is a near tie by vLLM's
check_logprobs_close rule (each path's token in the other's top 5). bf16 alone can move a token
far: H200, tiny-v3 fp8-block, a prompt where the float32 reference puts its token at -1.32 and the
next at -2.66; every bf16 path (CPU torch, GPU torch, GPU kernels, eager or graphs) puts three
tokens within 0.2 of -2.4 there, and which one wins is rounding (scripts/diag_fp8_decode.py). At
least half the prompts must agree on 8.
Prompts: of a pool of held-out prose windows, the N_PROMPTS on which the CPU reference's first 8
greedy decisions are the most decisive (largest smallest top-1 / top-2 logprob gap), chosen from
the reference alone.
The CPU test checks the llm-compressor-style builder and dsquant's reading of its output, so CI
exercises them without a GPU. A table of the figures is printed at the end of the module.

H200: python -m pytest -q tests/runtime/test_gpu_trained_accuracy.py -p no:cacheprovider -rA
"""
from __future__ import annotations

import gc
import math
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import llmc_artifacts as llmc
from dsquant.assets import bundled_model_path, bundled_models
from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
from dsquant.data import eval_tokens, load_tokenizer
from dsquant.formats import fp8_block
from dsquant.models.layers import Backends
from dsquant.runtime.layers.linear import QuantLinear
from dsquant.runtime.loader import load_runtime_model
from dsquant.validate.accuracy import compare
from dsquant.validate.runner import _runtime_model

MODELS = ("dsq-tiny-v3", "dsq-tiny-qwen2")
RECIPES = ("rtn-w4g128", "awq-w4g128", "gptq-w4g128", "fp8-block", "mixed-fp8attn-w4experts")
CT = tuple(llmc.SCHEMES)  # ("ct-w4a16", "ct-fp8-block")
VARIANTS = ("bf16",) + RECIPES + CT
CASES = [(m, v) for m in MODELS for v in VARIANTS]

N_SAMPLES, SEQLEN = 8, 256  # calibration: the test compares two paths on one artifact, not recipes
EVAL_SET, EVAL_TOKENS, WINDOW, STRIDE = "eval_prose", 8192, 512, 256
POOL, POOL_STRIDE = 24, 640  # candidate prompts: windows of the prose after the perplexity slice
N_PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 128, 16

PPL_TOL = 0.005  # GPU perplexity within 0.5% of the CPU reference's
TOP1_MIN = 0.98  # argmax agreement, GPU vs CPU reference
AGREE_MIN = 8  # greedy tokens equal from the first on, per prompt
# The bf16 floor (CPU pure torch in bf16, no GPU kernel, against the same float32 reference) misses
# the figures itself; measured on the H200 (2026-12-01, 4096 tokens): top-1 < 0.98 in 13 of
# 16 cases (0.918-0.978; FP8 W8A8 0.92-0.95), perplexity -0.96% for FP8 on tiny-v3. A GPU figure
# that misses a threshold must sit at the floor; GPU minus floor measured: top-1 -0.011..+0.007,
# perplexity -0.49..+0.57 points.
FLOOR_PPL, FLOOR_TOP1 = 0.0075, 0.02
TOP_K = 5  # logprobs per greedy token, for the near-tie rule (vLLM's check_logprobs_close)
FLOOR_KL, KL_EPS = 2.0, 1e-3  # layout errors measured at 57581c7: KL 0.11 (ct FP8) to several nats
KNOWN_MISSES: dict[tuple[str, str], str] = {}  # (model, variant) -> reason: strict xfail
# CPU sanity: what an llm-compressor artifact may cost over BF16 (min-max RTN; measured on the CPU:
# W4A16 symmetric +4.2% v3, +5.4% qwen2; FP8_BLOCK +0.6%, +1.0%): a layout error costs far more
CT_PPL_VS_BF16 = {"ct-w4a16": 0.08, "ct-fp8-block": 0.02}
CPU_EVAL_TOKENS = 2048  # the CPU test's slice of the same tokens
CT_PPL_VS_TWIN, CT_TOP1_VS_TWIN = 1e-4, 0.999  # CPU: the artifact vs the dense twin of its weights

pytestmark = pytest.mark.skipif(set(MODELS) - set(bundled_models()), reason="bundled models not in this checkout")


class Artifacts:
    """(model, variant) -> checkpoint directory, each built once, on first use (so -k selects cheaply)."""

    def __init__(self, root: Path):
        self.root, self.paths, self.seconds = root, {}, {}
        self._tokens: dict[str, tuple[torch.Tensor, list[list[int]]]] = {}

    def path(self, model: str, variant: str) -> str:
        key = (model, variant)
        if key not in self.paths:
            base, out = bundled_model_path(model), self.root / model / variant
            t0 = time.perf_counter()
            if variant == "bf16":
                path = base
            elif variant in llmc.SCHEMES:
                path = llmc.build(base, out, variant, twin_dir=self.twin(model, variant))
            else:
                path = run_quantize(QuantizeArgs(str(base), variant, str(out), n_samples=N_SAMPLES,
                                                 seqlen=SEQLEN, force=True)).out_dir
            self.paths[key], self.seconds[key] = str(path), time.perf_counter() - t0
        return self.paths[key]

    def twin(self, model: str, variant: str) -> Path:
        """The dense checkpoint of the weights an llm-compressor artifact encodes (built with it)."""
        return self.root / model / f"{variant}-dense-twin"

    def eval_data(self, model: str) -> tuple[torch.Tensor, list[list[int]]]:
        """(the first EVAL_TOKENS tokens of the prose set, POOL candidate prompts of PROMPT_LEN
        tokens each, every POOL_STRIDE tokens after them)."""
        if model not in self._tokens:
            tokenizer = load_tokenizer(bundled_model_path(model))
            stream = eval_tokens(tokenizer, EVAL_SET, max_tokens=EVAL_TOKENS + POOL * POOL_STRIDE)
            pool = [stream[s:s + PROMPT_LEN].tolist() for s in range(EVAL_TOKENS, len(stream) - PROMPT_LEN, POOL_STRIDE)]
            assert len(pool) == POOL, f"{EVAL_SET}: too short for {POOL} prompts"
            self._tokens[model] = (stream[:EVAL_TOKENS], pool)
        return self._tokens[model]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Artifacts:
    return Artifacts(tmp_path_factory.mktemp("trained_accuracy"))


@pytest.fixture(scope="module")
def table(request, artifacts):
    """Rows of figures, (model, variant) -> {column: value}; printed when the module ends."""
    rows: dict[tuple[str, str], dict] = {}
    yield rows
    if not rows:
        return
    cols = [("cpu ppl", "{:.3f}"), ("gpu ppl", "{:.3f}"), ("diff %", "{:+.3f}"), ("floor %", "{:+.3f}"),
            ("top-1", "{:.4f}"), ("floor top-1", "{:.4f}"), ("KL", "{:.2e}"), ("floor KL", "{:.2e}"),
            ("tokens agreed", "{}"), ("floor agreed", "{}"), ("near ties", "{}"),
            ("min gap", "{:.3f}"), ("vs bf16 %", "{:+.2f}"), ("vs twin %", "{:+.4f}"), ("build s", "{:.1f}")]
    used = [(c, f) for c, f in cols if any(c in r for r in rows.values())]
    header = f"{'model':<15} {'variant':<24} " + " ".join(f"{c:>13}" for c, _ in used)
    lines = ["", f"trained-weight accuracy ({EVAL_SET}, window {WINDOW}, stride {STRIDE}; GPU test {EVAL_TOKENS} "
             f"tokens, CPU test {CPU_EVAL_TOKENS}; floor: CPU torch bf16 vs float32; min gap: smallest top-2 "
             f"logprob gap of the reference over the chosen prompts' first {AGREE_MIN} tokens)", header]
    for (model, variant), r in sorted(rows.items(), key=lambda kv: (MODELS.index(kv[0][0]), VARIANTS.index(kv[0][1]))):
        cells = [f"{(f.format(r[c]) if c in r else '-'):>13}" for c, f in used]
        lines.append(f"{model:<15} {variant:<24} " + " ".join(cells))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        reporter.write_line(line) if reporter is not None else print(line)


def _row(table, artifacts, model, variant) -> dict:
    row = table.setdefault((model, variant), {})
    if (model, variant) in artifacts.seconds and variant != "bf16":
        row["build s"] = artifacts.seconds[(model, variant)]
    return row


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _on_cuda(model):
    """Callable ids [B, T] (CPU) -> float32 logits on the CPU, running `model` on the GPU."""
    return lambda ids: model(ids.to("cuda")).float().cpu()


def _engine_config(device: str, dtype: torch.dtype = torch.float32, seqs: int = N_PROMPTS):
    from dsquant.runtime.engine.llm_engine import EngineConfig

    blocks = seqs * -(-(PROMPT_LEN + NEW_TOKENS) // 16) + 8
    common = dict(block_size=16, num_blocks=blocks, max_model_len=WINDOW, max_num_seqs=seqs)
    if device == "cpu":  # the reference: pure torch everywhere (float32; bf16 for the floor)
        return EngineConfig(device="cpu", dtype=dtype, kernels=False, **common)
    return EngineConfig(device="cuda", enforce_eager=False, kernels=True, cuda_graph_max_batch=seqs, **common)


def _greedy(engine, prompts: list[list[int]], logprobs: int | None = None) -> list:
    """The engine's RequestOutputs of greedy completions (NEW_TOKENS, ignore_eos), in prompt order."""
    from dsquant.runtime.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=logprobs)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return [done[i] for i in ids]


def _min_gap(out) -> float:
    """Smallest top-1 / top-2 logprob gap over the first AGREE_MIN completion tokens."""
    gaps = []
    for _, top in out.logprobs[:AGREE_MIN]:
        best = sorted(top.values(), reverse=True)
        gaps.append(best[0] - best[1])
    return min(gaps)


def _counting(replay, calls: list[int]):
    """`replay` (DecodeGraphs.replay), recording each call's batch size in `calls`."""
    def counted(n: int):
        calls.append(n)
        return replay(n)
    return counted


def _agreed(a: list[int], b: list[int]) -> int:
    """Length of the common prefix."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _reference_prompts(path: str, pool: list[list[int]]) -> tuple[list[list[int]], list, float]:
    """(the N_PROMPTS prompts of `pool` on which the CPU reference engine's first AGREE_MIN greedy
    tokens are the most decisive, its RequestOutputs for them (TOP_K logprobs), their smallest
    top-2 gap)."""
    from dsquant.runtime.engine.llm_engine import LLMEngine

    engine = LLMEngine(path, _engine_config("cpu", seqs=len(pool)))
    outs = _greedy(engine, pool, logprobs=TOP_K)
    del engine
    ranked = sorted(range(len(pool)), key=lambda i: -_min_gap(outs[i]))[:N_PROMPTS]
    return [pool[i] for i in ranked], [outs[i] for i in ranked], min(_min_gap(outs[i]) for i in ranked)


def _logit_failures(diff, top1, kl, floor_diff, floor_top1, floor_kl) -> list[str]:
    """The logit checks: each figure meets the issue's threshold (perplexity within PPL_TOL, top-1 >=
    TOP1_MIN) or sits at the bf16 floor (perplexity deviation within FLOOR_PPL of the floor's, top-1
    at most FLOOR_TOP1 below it); and always the mean KL to the reference is at most FLOOR_KL x the
    floor's (+ KL_EPS), the check a layout error fails by orders of magnitude."""
    out = []
    if abs(diff) > PPL_TOL and abs(diff - floor_diff) > FLOOR_PPL:
        out.append(f"GPU perplexity {100 * diff:+.3f}% off the CPU reference (limit {100 * PPL_TOL}%; "
                   f"bf16 floor {100 * floor_diff:+.3f}%, allowed within {100 * FLOOR_PPL} points of it)")
    if top1 < TOP1_MIN and top1 < floor_top1 - FLOOR_TOP1:
        out.append(f"top-1 agreement {top1:.4f} < {TOP1_MIN} (bf16 floor {floor_top1:.4f}, "
                   f"allowed {FLOOR_TOP1} below it)")
    if not kl <= FLOOR_KL * floor_kl + KL_EPS:
        out.append(f"mean KL {kl:.3e} > {FLOOR_KL} x the bf16 floor's {floor_kl:.3e} + {KL_EPS}")
    return out


def _near_tie(ref, got, at: int) -> bool:
    """vLLM's check_logprobs_close rule at the first differing token `at` of two RequestOutputs
    (token_ids, logprobs: (chosen logprob, {id: logprob} of the top TOP_K) per token): each path's
    token is among the other's TOP_K, a flip between close candidates, not a wrong distribution."""
    if at >= min(len(ref.token_ids), len(got.token_ids)):
        return True
    return got.token_ids[at] in ref.logprobs[at][1] and ref.token_ids[at] in got.logprobs[at][1]


def _greedy_failures(agreed, floor_agreed, near, want, got, gap) -> list[str]:
    """Greedy: every prompt agrees on AGREE_MIN tokens, unless the bf16 floor also diverges on it
    before AGREE_MIN, or the GPU's first difference from the reference or from the bf16 floor is a
    near tie (_near_tie); at least half the prompts agree on AGREE_MIN tokens."""
    bad = [i for i, (a, fa, n) in enumerate(zip(agreed, floor_agreed, near)) if a < AGREE_MIN <= fa and not n]
    out = []
    if bad or sum(a >= AGREE_MIN for a in agreed) * 2 < len(agreed):
        out.append(f"greedy: tokens agreed {agreed}, bf16 floor {floor_agreed} (first {AGREE_MIN} needed where the "
                   f"floor has them; reference's smallest top-2 gap {gap:.3f}); "
                   f"cpu {[w[:AGREE_MIN] for w in want]} gpu {[g[:AGREE_MIN] for g in got]}")
    return out


# --------------------------------------------------------------------------- GPU vs CPU
@pytest.mark.gpu
@pytest.mark.timeout(900)  # builds its artifact on the CPU first (AWQ: about a minute)
@pytest.mark.parametrize("model,variant", CASES)
def test_gpu_serving_path_matches_cpu_reference(model, variant, artifacts, table, request):
    """For the same checkpoint, against the CPU reference (float32, pure torch), each figure at the
    issue's threshold or at the bf16 floor (_logit_failures, _greedy_failures):
    1. on the same windows of held-out prose, the GPU serving path's (bf16, Triton quantized
       GEMMs, fused MoE) perplexity is within 0.5% of the reference's;
    2. the argmax of its logits agrees with the reference's on >= 98% of the tokens; mean KL;
    3. greedy generation through the engine on CUDA with CUDA graphs on (decode steps replay the
       captured graphs: GEMV kernels, paged attention) gives the reference engine's tokens on at
       least the first 8 of 16, for every prompt (the reference's most decisive of the pool)."""
    from dsquant.runtime.engine.llm_engine import LLMEngine

    reason = KNOWN_MISSES.get((model, variant))
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    path = artifacts.path(model, variant)
    tokens, pool = artifacts.eval_data(model)
    row = _row(table, artifacts, model, variant)
    failures = []

    # 1, 2: logits of the serving path vs the reference, and the bf16 floor on the same windows
    cpu = _runtime_model(path, "cpu")
    gpu = _runtime_model(path, "cuda")
    base, res = compare(cpu, {"gpu": _on_cuda(gpu)}, tokens, EVAL_SET, WINDOW, STRIDE, "cpu")
    del gpu
    _release()
    floor = load_runtime_model(path, Backends(), dtype=torch.bfloat16, device="cpu")
    f = compare(cpu, {"floor": floor}, tokens, EVAL_SET, WINDOW, STRIDE, "cpu")[1]["floor"]
    del floor, cpu
    cpu_ppl, gpu_ppl = base.perplexity.value, res["gpu"].perplexity.value
    diff, top1, kl = gpu_ppl / cpu_ppl - 1, res["gpu"].top1_agreement.value, res["gpu"].kl_mean.value
    floor_diff, floor_top1, floor_kl = f.perplexity.value / cpu_ppl - 1, f.top1_agreement.value, f.kl_mean.value
    row.update({"cpu ppl": cpu_ppl, "gpu ppl": gpu_ppl, "diff %": 100 * diff, "floor %": 100 * floor_diff,
                "top-1": top1, "floor top-1": floor_top1, "KL": kl, "floor KL": floor_kl})
    failures.extend(_logit_failures(diff, top1, kl, floor_diff, floor_top1, floor_kl))
    if not math.isfinite(gpu_ppl):
        failures.append(f"GPU perplexity {gpu_ppl}")

    # 3: greedy through the engine, CUDA graphs on
    prompts, ref, gap = _reference_prompts(path, pool)
    want = [o.token_ids for o in ref]
    engine = LLMEngine(path, _engine_config("cuda"))
    graphs = engine.runner.graphs
    assert graphs is not None, f"{model} {variant}: CUDA graph capture failed (the engine decoded eagerly)"
    replays: list[int] = []
    graphs.replay = _counting(graphs.replay, replays)
    outs = _greedy(engine, prompts, logprobs=TOP_K)
    got = [o.token_ids for o in outs]
    engine.close()
    del engine, graphs
    _release()
    agreed = [_agreed(w, g) for w, g in zip(want, got)]
    row.update({"tokens agreed": "/".join(map(str, agreed)), "min gap": gap})
    assert replays, f"{model} {variant}: no decode step replayed a CUDA graph"
    assert all(len(g) == NEW_TOKENS for g in got)
    if any(a < AGREE_MIN for a in agreed):  # the bf16 floor: the CPU reference engine in bf16, same prompts
        engine = LLMEngine(path, _engine_config("cpu", torch.bfloat16))
        floor = _greedy(engine, prompts, logprobs=TOP_K)
        del engine
        floor_agreed = [_agreed(w, o.token_ids) for w, o in zip(want, floor)]
        row["floor agreed"] = "/".join(map(str, floor_agreed))
        near = [_near_tie(r, o, a) or _near_tie(fl, o, _agreed(fl.token_ids, o.token_ids))
                for r, o, fl, a in zip(ref, outs, floor, agreed)]
        row["near ties"] = "/".join("y" if n else "-" for n in near)
        failures.extend(_greedy_failures(agreed, floor_agreed, near, want, got, gap))

    print(f"{model} {variant}: cpu ppl {cpu_ppl:.3f}, gpu ppl {gpu_ppl:.3f} ({100 * diff:+.3f}%, floor "
          f"{100 * floor_diff:+.3f}%), top-1 {top1:.4f} (floor {floor_top1:.4f}), KL {kl:.2e} (floor {floor_kl:.2e}); greedy agreed {agreed} (reference gap {gap:.3f}), "
          f"{len(replays)} graph replays")
    assert not failures, f"{model} {variant}: " + "; ".join(failures)


# --------------------------------------------------------------------------- CPU: the builder
def _compressed_modules(path: str) -> set[str]:
    keys = set()
    for shard in Path(path).glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            keys |= set(f.keys())
    return {k.rsplit(".", 1)[0] for k in keys if k.endswith(".weight_scale")}


@pytest.mark.parametrize("variant", CT)
@pytest.mark.parametrize("model", MODELS)
def test_llmcompressor_artifact_loads_on_cpu(model, variant, artifacts, table, monkeypatch):
    """An artifact laid out as llm-compressor writes it (compressed_tensors' own preset, min-max
    qparams, compressors and config) loads on the CPU through dsquant: every Linear the scheme
    targets runs the compressed-tensors method (lm_head, router, embeddings and norms stay
    unquantized), its dequantized weight equals compressed_tensors' own decompression, its logits
    match the dense twin's (perplexity within 0.01%, top-1 >= 99.9%; FP8 compared without W8A8's
    activation rounding, which the twin lacks), and its perplexity is within 2% (FP8_BLOCK) or 8%
    (W4A16, symmetric RTN) of BF16's."""
    path = artifacts.path(model, variant)
    twin = artifacts.twin(model, variant)
    qcfg = llmc.quantization_config(path)
    group = qcfg["config_groups"]["group_0"]
    fmt, method = {"ct-w4a16": ("pack-quantized", "ct_int4"), "ct-fp8-block": ("float-quantized", "ct_fp8")}[variant]
    assert (qcfg["quant_method"], qcfg["format"], group["targets"]) == ("compressed-tensors", fmt, ["Linear"])
    assert "lm_head" in qcfg["ignore"]
    if model == "dsq-tiny-v3":
        assert any(n.endswith("mlp.gate") for n in qcfg["ignore"])

    art = _runtime_model(path, "cpu")
    compressed = _compressed_modules(path)
    assert art.linear_methods == {method: len(compressed), "dense": 1}, art.linear_methods  # dense: lm_head
    with safe_open(str(twin / "model.safetensors"), framework="pt") as f:
        for name, mod in art.named_modules():
            if isinstance(mod, QuantLinear) and mod.method.name != "dense":
                ref = f.get_tensor(f"{name}.weight")  # [N, K] fp32
                torch.testing.assert_close(mod.cpu_weight, ref, rtol=1e-6, atol=0, msg=lambda m: f"{name}: {m}")
                compressed.discard(name)
    assert not compressed, f"compressed modules dsquant did not load as such: {sorted(compressed)[:5]}"

    tokens = artifacts.eval_data(model)[0][:CPU_EVAL_TOKENS]
    dense = _runtime_model(str(twin), "cpu")
    with monkeypatch.context() as mp:
        if variant == "ct-fp8-block":
            mp.setattr(fp8_block, "fp8_activation_roundtrip", lambda x, group=128, dtype=None: x.to(dtype or x.dtype))
        twin_acc, res = compare(dense, {"art": art}, tokens, EVAL_SET, WINDOW, STRIDE, "cpu")
    vs_twin, twin_top1 = res["art"].perplexity.value / twin_acc.perplexity.value - 1, res["art"].top1_agreement.value
    del dense
    base, res = compare(_runtime_model(str(bundled_model_path(model)), "cpu"), {"art": art}, tokens, EVAL_SET,
                        WINDOW, STRIDE, "cpu")
    ppl = res["art"].perplexity.value
    vs_bf16 = ppl / base.perplexity.value - 1
    row = _row(table, artifacts, model, variant)
    row.update({"vs bf16 %": 100 * vs_bf16, "vs twin %": 100 * vs_twin})
    print(f"{model} {variant} (CPU): ppl {ppl:.3f}, bf16 {base.perplexity.value:.3f} ({100 * vs_bf16:+.2f}%), "
          f"top-1 vs bf16 {res['art'].top1_agreement.value:.4f}; vs dense twin {100 * vs_twin:+.4f}%, "
          f"top-1 {twin_top1:.4f}")
    assert abs(vs_twin) <= CT_PPL_VS_TWIN and twin_top1 >= CT_TOP1_VS_TWIN, (
        f"{model} {variant}: {100 * vs_twin:+.4f}% perplexity, top-1 {twin_top1:.4f} vs its dense twin")
    assert vs_bf16 <= CT_PPL_VS_BF16[variant], f"{model} {variant}: {100 * vs_bf16:+.2f}% perplexity over BF16"


def test_criteria_tell_rounding_from_a_layout_error():
    """The GPU test's criteria, on figures measured on the H200: FP8 at 57581c7 (wrong scale layout:
    perplexity +71678%, top-1 0.014) fails every check; the fixed path's worst case passes."""
    assert len(_logit_failures(716.78, 0.014, 5.1, -0.0096, 0.929, 0.012)) == 3
    assert _logit_failures(-0.00836, 0.9270, 0.0110, -0.00343, 0.9375, 0.0095) == []
    assert _logit_failures(0.03, 0.93, 0.05, 0.001, 0.935, 0.010)  # a 3% shift away from the floor
    ids = [[1] * 16] * 4
    assert _greedy_failures([0, 0, 0, 0], [16, 16, 5, 0], [False] * 4, ids, ids, 0.2)
    assert _greedy_failures([4, 16, 16, 0], [11, 16, 16, 16], [False, True, True, True], ids, ids, 0.2)
    assert _greedy_failures([10, 16, 16, 0], [2, 16, 5, 0], [False] * 4, ids, ids, 0.2) == []
    assert _greedy_failures([4, 11, 16, 7], [11, 16, 16, 16], [True] * 4, ids, ids, 0.2) == []
    from types import SimpleNamespace as Out

    ref = Out(token_ids=[7, 7, 7, 7], logprobs=[(-0.1, {7: -0.1, 9: -0.5})] * 4)
    flip = Out(token_ids=[7, 7, 7, 9], logprobs=[(-0.1, {7: -0.1})] * 3 + [(-0.2, {9: -0.2, 7: -0.4})])
    wrong = Out(token_ids=[7, 7, 7, 5], logprobs=[(-0.1, {7: -0.1})] * 3 + [(-0.01, {5: -0.01, 3: -6.0})])
    assert _near_tie(ref, flip, 3) and not _near_tie(ref, wrong, 3)
