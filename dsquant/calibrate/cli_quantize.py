"""The `dsquant quantize` command: progress bar over layers, summary table at the end."""
from __future__ import annotations

from collections import defaultdict

import click

from dsquant.calibrate.presets import scheme_names
from dsquant.calibrate.recipe import bundled_recipes
from dsquant.cli_options import device_option
from dsquant.errors import DsquantError
from dsquant.export.codecs import FORMATS


ERROR_LEGEND = ("rel err: relative output error of each quantized module on its calibration inputs, "
                "||X (W_q - W)^T|| / ||X W^T|| (X: the module's captured inputs with the layers before it "
                "already quantized); mean and max over the modules of a type")


def _summary(report) -> str:
    """Error, time and memory per module type (layer/expert indices folded); the modules that fell
    back from their recipe scheme, per-layer expert coverage and its warnings (models/manifest.py)."""
    from dsquant.models.manifest import manifest_report
    from dsquant.models.summary import human, module_type

    manifest = report.manifest
    by_type: dict[str, list[float]] = defaultdict(list)
    for name, err in report.module_errors.items():
        by_type[module_type(name)].append(err)
    schemes = manifest["recipe"]
    width = max(len(t) for t in by_type) if by_type else 10
    lines = [ERROR_LEGEND, "",
             f"{'module type':<{width}}  {'count':>5}  {'mean rel err':>12}  {'max rel err':>11}"]
    for t, errs in sorted(by_type.items()):
        lines.append(f"{t:<{width}}  {len(errs):>5}  {sum(errs) / len(errs):>12.4f}  {max(errs):>11.4f}")
    secs = [v["seconds"] for v in manifest["layers"].values()]
    lines += ["",
              f"recipe {schemes['name']} -> format {manifest['format']}; {len(secs)} layers in "
              f"{manifest['seconds_total']:.1f} s (slowest layer {max(secs, default=0):.1f} s)",
              f"peak memory: host {human(manifest['peak_host_bytes'], 'B')}, "
              f"device {human(manifest['peak_device_bytes'], 'B')}"]
    report_lines = manifest_report(manifest)  # shape fallbacks, expert coverage, its warnings
    return "\n".join(lines + ([""] + report_lines if report_lines else []))


def parse_size(value: str | int | None, flag: str = "--max-shard-size") -> int | None:
    """Bytes from an int or a string such as "5GB" (10**9), "5GiB" (2**30), "500MB", "64KiB";
    a lower-case trailing "b" means bits ("5Gb" is 5 * 10**9 / 8), as transformers reads it."""
    if value is None or isinstance(value, int):
        return value
    text = value.strip()
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    number = text.rstrip("KMGTIBkmgtib")
    unit = text[len(number):]
    try:
        size = float(number) * units[unit.upper()]
    except (KeyError, ValueError):
        raise DsquantError(f"{flag} {value}: expected a size such as 5GB, 500MB, 2GiB or a number of bytes") from None
    if unit.endswith("b") and unit.upper() != "B":
        size /= 8
    if size < 1:
        raise DsquantError(f"{flag} {value}: must be at least one byte")
    return int(size)


def build_recipe(recipe: str | None, scheme: str | None, algorithm: str | None, group_size: int | None,
                 ignore: tuple[str, ...]):
    """The Recipe of --recipe or of --scheme (+ --algorithm, --group-size); --ignore joins its keep list."""
    from dsquant.calibrate.presets import preset_recipe
    from dsquant.calibrate.recipe import load_recipe

    if (recipe is None) == (scheme is None):
        raise click.UsageError("give either --recipe (a YAML recipe) or --scheme (a preset such as W4A16), "
                               "exactly one")
    if recipe is not None:
        for flag, value in (("--algorithm", algorithm), ("--group-size", group_size)):
            if value is not None:
                raise click.UsageError(f"{flag} goes with --scheme; a --recipe sets it in its YAML")
        loaded = load_recipe(recipe)
        loaded.keep = loaded.keep + list(ignore)
        return loaded
    return preset_recipe(scheme, algorithm, group_size, ignore)


@click.command(short_help="Calibrate and quantize a checkpoint into an artifact.")
@click.argument("model_dir", type=click.Path(path_type=str))
@click.option("--recipe", default=None,
              help=f"Recipe YAML path or bundled name ({', '.join(r[:-5] for r in bundled_recipes())}).")
@click.option("--scheme", default=None, metavar="NAME",
              help=f"Instead of --recipe, an llm-compressor preset: {scheme_names()} (W4A16 is symmetric INT4, "
                   "GPTQ; W4A16_ASYM has zero points, AWQ by default).")
@click.option("--algorithm", default=None, type=click.Choice(["awq", "gptq", "rtn"], case_sensitive=False),
              help="With --scheme: how the grid is found. Default: gptq for W4A16, awq for W4A16_ASYM, "
                   "rtn for FP8_BLOCK.")
@click.option("--group-size", default=None, type=int, help="With --scheme W4A16*: 32, 64 or 128 (default 128).")
@click.option("--ignore", multiple=True, metavar="PATTERN",
              help="Leave matching modules in BF16 (fnmatch on the full name, e.g. '*.self_attn.*'); repeatable. "
                   "lm_head, embeddings, the router and norms always stay BF16.")
@click.option("--format", "fmt", default="auto", show_default=True, type=click.Choice(FORMATS),
              help="Artifact format. auto: awq (AWQ/RTN), gptq (GPTQ), fp8 (FP8 block), compressed-tensors (mixed); "
                   "compressed-tensors: llm-compressor's pack-quantized / float-quantized, for any recipe.")
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(path_type=str), help="Artifact directory.")
@click.option("--calib", default=None, help="Calibration text (.txt, .jsonl, .parquet, saved dataset dir).")
@click.option("--calib-column", default=None, help="With --calib: the text column or field (default text).")
@click.option("--calib-split", default=None, help="With --calib: the split of a saved DatasetDict (default train).")
@click.option("--n-samples", default=128, show_default=True, type=click.IntRange(min=1),
              help="Calibration sequences.")
@click.option("--seqlen", default=512, show_default=True, type=click.IntRange(min=2),
              help="Tokens per calibration sequence.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the calibration sample draw.")
@click.option("--max-shard-size", default=None, metavar="SIZE",
              help="Largest safetensors file, e.g. 5GB or 2GiB; a bigger layer is split over several files "
                   "(tensors are never split). Default: one file per decoder layer.")
@device_option()
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
def quantize(model_dir, recipe, scheme, algorithm, group_size, ignore, fmt, out_dir, calib, calib_column, calib_split,
             n_samples, seqlen, seed, max_shard_size, device, force):
    """Calibrate MODEL_DIR layer by layer into an AWQ, GPTQ, FP8 block or mixed artifact.

    MODEL_DIR is a checkpoint directory or a bundled model name. Give a recipe (--recipe) or a
    preset (--scheme W4A16 | W4A16_ASYM | FP8_BLOCK, with --algorithm, --group-size, --ignore).
    """
    import torch
    from tqdm import tqdm

    from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
    from dsquant.assets import resolve_model_dir

    if calib is None and (calib_column is not None or calib_split is not None):
        raise click.UsageError("--calib-column and --calib-split need --calib PATH")
    recipe_obj = build_recipe(recipe, scheme, algorithm, group_size, ignore)
    max_shard_bytes = parse_size(max_shard_size)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    args = QuantizeArgs(resolve_model_dir(model_dir), recipe_obj, out_dir, calib, n_samples, seqlen, seed,
                        device, force, format=fmt, max_shard_bytes=max_shard_bytes,
                        calib_column=calib_column or "text", calib_split=calib_split)
    bar = inner = None

    def progress(done, total, stats):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, initial=done - 1, desc="layers", unit="layer", position=0)
        bar.update(1)

    def module_progress(layer, done, total, what):  # inside a layer: AWQ groups, then each module / expert
        nonlocal inner
        if inner is None:
            inner = tqdm(total=total, unit="module", position=1, leave=False)
        if done == 1 or inner.total != total:
            inner.reset(total=total)
        inner.set_description(f"layer {layer}", refresh=False)
        inner.set_postfix_str(what[-40:], refresh=False)
        inner.update(done - inner.n)

    try:
        report = run_quantize(args, progress, module_progress)
    finally:
        for b in (inner, bar):
            if b is not None:
                b.close()
    click.echo(_summary(report))
    click.echo(f"artifact: {report.out_dir}")
