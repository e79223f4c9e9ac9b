"""Where an engine step's time goes: the host's own work against the GPU's (diagnostics).

With `LLMEngine.step_times = StepTimes()` set, every engine.step() call that launches a step records
one StepRecord:
- `rows`: the sequences the launched step samples for (a batch-B decode step has B);
- `steps`: the decode steps the launch ran (> 1: a multi-step burst, multi_step.py);
- `wall_s`: the wall time of the whole step() call;
- `wait_s`: the time the host spent in it waiting for sampled tokens (SampledTokens.tolist), so
  `wall_s - wait_s` is the host's own work: scheduling, input preparation, launches, post-processing;
- `cpu_s`: the process's CPU time over the call (time.process_time, every thread): near `wall_s`
  when the host works throughout, lower when it waits or its thread is descheduled;
- `gpu`: two CUDA events around the step's model forward (its CUDA graph replay, or the eager
  forward) and sampling, enqueued back to back, so their elapsed time is the GPU's time for the
  step (None on CPU, where the forward runs inside the host's work).
Under async scheduling the GPU runs step N + 1 while the host post-processes step N and prepares
N + 2, so a steady decode step costs about max(host work, GPU time): `split(rows)` gives both.
Recording costs two events per step; the engine's default (None) records nothing.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class StepRecord:
    rows: int
    steps: int = 1
    wall_s: float = 0.0
    wait_s: float = 0.0
    cpu_s: float = 0.0
    gpu: tuple | None = None  # (start, end) torch.cuda.Event with timing, recorded by the runner


@dataclass
class StepTimes:
    records: list[StepRecord] = field(default_factory=list)
    current: StepRecord | None = None  # the record of the step() call under way

    def clear(self) -> None:
        self.records.clear()
        self.current = None

    def split(self, rows: int, since: int = 0) -> dict[str, float] | None:
        """Medians over the steps from records[since] on that sampled `rows` sequences, in
        microseconds per decode step (a burst's times divided by its steps): wall, host (wall minus
        the wait for tokens) and gpu (NaN on CPU); None when no such step. Reads the CUDA events, so
        it synchronizes on them: call it after the timed runs."""
        recs = [r for r in self.records[since:] if r.rows == rows]
        if not recs:
            return None
        gpu = [r.gpu[0].elapsed_time(r.gpu[1]) * 1e3 / r.steps for r in recs if r.gpu is not None]
        return {"steps": len(recs),
                "wall_us": statistics.median(r.wall_s / r.steps for r in recs) * 1e6,
                "host_us": statistics.median((r.wall_s - r.wait_s) / r.steps for r in recs) * 1e6,
                "gpu_us": statistics.median(gpu) if gpu else float("nan")}
