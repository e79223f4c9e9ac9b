"""`dsquant validate --lm-eval TASKS`: lm-evaluation-harness tasks against `dsquant serve`.

For each checkpoint (baseline and artifacts) a `dsquant serve` subprocess starts on a free
loopback port (`--port 0`; the bound address is read from its log), /health is awaited, and
lm-eval's `local-completions` model runs the tasks over /v1/completions with the checkpoint's
own tokenizer (requests are sent as token ids, so lm-eval's context lengths match the server's
token positions exactly). Loglikelihood tasks use the server's `echo` + `logprobs`. The server
then gets SIGTERM, and SIGKILL if it has not exited after STOP_TIMEOUT_S, whatever happened.

TASKS is a comma-separated list of lm-eval task, group or tag names, and paths to task YAML
files or folders of them (a folder path must contain a "/", e.g. ./my_tasks). dsquant's bundled offline tasks (dsquant/assets/lm_eval_tasks, built
from the held-out eval split) are always on the include path: dsq_prose_cloze (loglikelihood),
dsq_prose_choice (multiple choice), dsq_prose_cloze_gen (generate_until), or the tag `dsquant`.
"""
from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from dsquant.errors import DsquantError

BUNDLED_TASKS_DIR = Path(__file__).resolve().parent.parent / "assets" / "lm_eval_tasks"
INSTALL_HINT = "pip install 'dsquant[lmeval]' (or: pip install 'lm-eval[api]')"
STOP_TIMEOUT_S = 30.0
START_TIMEOUT_S = 600.0  # a large checkpoint loads for minutes


@dataclass
class LmEvalSpec:
    tasks: list[str]  # lm-eval task/group/tag names
    include_paths: list[str]  # folders scanned for task YAMLs (bundled first)
    limit: int | None = None  # examples per task
    num_concurrent: int = 2
    max_retries: int = 3
    max_length: int = 2048  # lm-eval's context budget; capped at each server's max_model_len


def check_lm_eval() -> str:
    """lm_eval's version; a DsquantError saying how to install it when it (or its API extras) is missing."""
    try:
        import lm_eval
    except ImportError as e:
        missing = e.name
    else:  # local-completions needs these: lm-eval's [api] extra
        missing = next((m for m in ("aiohttp", "tenacity") if importlib.util.find_spec(m) is None), None)
    if missing is not None:
        raise DsquantError(f"--lm-eval needs lm-evaluation-harness with its API extras ({missing} is not "
                           f"installed): {INSTALL_HINT}")
    return getattr(lm_eval, "__version__", "unknown")


def parse_tasks(text: str, limit: int | None = None) -> LmEvalSpec:
    """LmEvalSpec from --lm-eval's comma-separated names and paths; unknown names fail here, before any work."""
    names, includes = [], [str(BUNDLED_TASKS_DIR)]
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        path = Path(item)
        if path.suffix in (".yaml", ".yml") and path.is_file():
            includes.append(str(path.resolve().parent))
            task = (yaml.load(path.read_text(), Loader=_IgnoreTags) or {}).get("task")
            if not task:
                raise DsquantError(f"--lm-eval {item}: the YAML has no `task:` name")
            names.append(str(task))
        elif "/" in item and path.is_dir():  # a bare word is a task name, even if a folder has it
            includes.append(str(path.resolve()))
            found = sorted(str(t) for y in path.glob("*.y*ml")
                           if (t := (yaml.load(y.read_text(), Loader=_IgnoreTags) or {}).get("task")))
            if not found:
                raise DsquantError(f"--lm-eval {item}: the folder holds no task YAML (a file with `task:`)")
            names += found
        else:
            names.append(item)
    if not names:
        raise DsquantError("--lm-eval: no task given (e.g. --lm-eval dsq_prose_cloze)")
    from lm_eval.tasks import TaskManager

    known = set(TaskManager(include_path=includes).all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise DsquantError(f"--lm-eval: unknown task(s) {', '.join(unknown)}; bundled offline tasks: "
                           "dsq_prose_cloze, dsq_prose_choice, dsq_prose_cloze_gen (tag: dsquant)")
    return LmEvalSpec(names, includes, limit)


class _IgnoreTags(yaml.SafeLoader):
    """Reads task YAMLs that use lm-eval's `!function` tag without importing their code."""


_IgnoreTags.add_multi_constructor("!", lambda loader, suffix, node: None)


class ServerProcess:
    """`dsquant serve PATH --port 0` as a subprocess; `with ServerProcess(...) as url:` stops it on exit."""

    def __init__(self, path: str, name: str, device: str, log_path: Path, kv_cache_dtype: str = "auto"):
        self.cmd = [sys.executable, "-m", "dsquant", "serve", path, "--port", "0", "--device", device,
                    "--served-model-name", name, "--max-num-seqs", "8", "--shutdown-timeout", "5",
                    "--kv-cache-dtype", kv_cache_dtype]
        self.log_path, self.proc = log_path, None

    def __enter__(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # its own session: a Ctrl-C at the terminal reaches dsquant validate, whose exit stops it
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> str:
        import urllib.request

        deadline, url = time.monotonic() + START_TIMEOUT_S, None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DsquantError(f"--lm-eval: `{' '.join(self.cmd[2:])}` exited with status "
                                   f"{self.proc.returncode} ({self._tail(1)}); see its log {self.log_path}")
            if url is None:
                m = re.search(r"on (http://[\d.]+:\d+) ", self.log_path.read_text(errors="replace"))
                url = m.group(1) if m else None
            if url is not None:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                        if r.status == 200:
                            return url
                except OSError:
                    pass
            time.sleep(0.2)
        raise DsquantError(f"--lm-eval: the server for {self.cmd[4]} was not healthy after {START_TIMEOUT_S:.0f} s; "
                           f"see {self.log_path}")

    def _tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM (the server drains and exits 0), then SIGKILL after STOP_TIMEOUT_S."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _max_model_len(url: str) -> int | None:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0].get("max_model_len")


def evaluate(url: str, name: str, tokenizer_path: str, spec: LmEvalSpec) -> dict[str, list[dict]]:
    """Run spec's tasks against the server at url: {task: [{metric, value, stderr}, ...]}."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    max_len = min(spec.max_length, _max_model_len(url) or spec.max_length)
    model_args = dict(model=name, base_url=f"{url}/v1/completions", tokenizer=tokenizer_path,
                      tokenizer_backend="huggingface", tokenized_requests=True, add_bos_token=True,
                      num_concurrent=spec.num_concurrent, max_retries=spec.max_retries, max_length=max_len,
                      max_gen_toks=min(256, max_len // 4), timeout=600)
    out = simple_evaluate(model="local-completions", model_args=model_args, tasks=spec.tasks, limit=spec.limit,
                          task_manager=TaskManager(include_path=spec.include_paths), log_samples=False,
                          bootstrap_iters=1000, verbosity="WARNING")
    return scores(out["results"])


def scores(results: dict) -> dict[str, list[dict]]:
    """lm-eval's results ({task: {"acc,none": v, "acc_stderr,none": s, ...}}) as metric rows."""
    table = {}
    for task, res in results.items():
        rows = []
        for key, value in res.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            stderr = res.get(f"{metric}_stderr,{filt}")
            rows.append({"metric": metric if filt == "none" else f"{metric} ({filt})", "value": float(value),
                         "stderr": float(stderr) if isinstance(stderr, (int, float)) else None})
        table[task] = rows
    return table


def run_lm_eval(path: str, name: str, device: str, spec: LmEvalSpec, out_dir: Path,
                log=print, kv_cache_dtype: str = "auto") -> dict[str, list[dict]]:
    """Serve one checkpoint (with its --kv-cache-dtype), run the tasks, stop the server (also on error)."""
    log(f"lm-eval: {name} ({', '.join(spec.tasks)})")
    log_path = out_dir / "lm_eval" / f"serve-{_safe(name)}.log"
    with ServerProcess(path, name, device, log_path, kv_cache_dtype) as url:
        return evaluate(url, name, path, spec)  # the checkpoint's own tokenizer files


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
