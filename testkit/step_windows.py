"""The engine's step trace (scheduler/step_trace.py) cut to a bench's windows: how many steps ran
in a window and their tokens, and what the steps that carried chats and batch work together were
made of (batch decode rows and prefill tokens, interactive rows and tokens), with the step cost
model's prediction against the time the engine measured (scripts/bench_mixed_gpu.py); and the
steps with grammar-constrained rows against the others (their time, the mask's fill, how long a
late-sampled step waited for its sampling).

    .venv/bin/python -m testkit.step_windows STEPS.jsonl   # a trace's summaries (any bench's)"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import median

# The step trace's fields that describe a mixed step, in the order a summary prints them.
PART_FIELDS = ("chat_rows", "chat_tokens", "batch_decode_rows", "batch_prefill_tokens", "kv_tokens",
               "tokens", "predicted_ms", "ms")


def read_trace(path: Path) -> list[dict]:
    """Every step line of a trace file (none if it is missing); a torn last line is skipped."""
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a process stopped mid-write
    return steps


# A window is at a steady state when its two halves' rates differ by at most this share.
LEVEL_TOLERANCE = 0.1


def is_level(earlier_tok_s: float, later_tok_s: float, tolerance: float = LEVEL_TOLERANCE) -> bool:
    """Whether two rates (a window's halves) agree within `tolerance` of the larger; nan: no."""
    larger = max(earlier_tok_s, later_tok_s)
    return larger > 0 and abs(later_tok_s - earlier_tok_s) <= tolerance * larger


def in_window(steps: list[dict], start: float, end: float) -> list[dict]:
    """The steps whose result came back within [start, end] (wall clock, time.time())."""
    return [s for s in steps if start <= s["t"] <= end]


def is_mixed(step: dict) -> bool:
    """A step that carried interactive rows and batch work together."""
    batch = step.get("batch_decode_rows", 0) + step.get("batch_prefill_tokens", 0)
    return step.get("chat_rows", 0) > 0 and batch > 0


@dataclass
class StepWindow:
    """A window of a run: its length, the fleet's generated tokens in it (the schedulers'
    generation counter), and the engine steps that came back in it."""

    label: str
    seconds: float
    generated_tokens: int
    steps: list[dict]
    # The generated tok/s of the window's two halves, where measured: a steady state has them
    # agree (is_level, above); a ramp or a drain does not.
    halves_tok_s: tuple[float, float] | None = None

    @property
    def tok_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def step_tokens(self) -> int:
        return sum(s["tokens"] for s in self.steps)

    def line(self) -> str:
        ms = [s["ms"] for s in self.steps]
        median_ms = f"{median(ms):.1f} ms" if ms else "-"
        return (f"{self.label}: {self.seconds:.1f} s, {self.generated_tokens:,} tokens generated "
                f"({self.tok_s:,.0f} tok/s{self._halves()}), {len(self.steps):,} steps of "
                f"{self.step_tokens:,} tokens (median step {median_ms})")

    def _halves(self) -> str:
        if self.halves_tok_s is None:
            return ""
        first, second = self.halves_tok_s
        level = "level" if is_level(first, second) else "NOT level: not a steady state"
        return f"; halves {first:,.0f} then {second:,.0f}, {level}"


def _median(steps: list[dict], name: str) -> str:
    values = [s[name] for s in steps if s.get(name) is not None]
    if not values:
        return "-"
    value = median(values)
    return f"{value:.1f}" if name.endswith("ms") else f"{value:,.0f}"


def mixed_summary(steps: list[dict], num_samples: int = 5) -> str:
    """Markdown: the medians of the mixed steps' parts (and of the steps of each kind), how often
    a step ran over its prediction, and a few mixed steps as they came."""
    mixed = [s for s in steps if is_mixed(s)]
    kinds = (("mixed steps", mixed),
             ("mixed, batch decodes only", [s for s in mixed if not s.get("batch_prefill_tokens")]),
             ("mixed, with batch prefill", [s for s in mixed if s.get("batch_prefill_tokens")]),
             ("chats only", [s for s in steps if s.get("chat_rows") and not is_mixed(s)]),
             ("batch only", [s for s in steps if not s.get("chat_rows")]))
    lines = _median_table(kinds, PART_FIELDS)
    predicted = [s for s in mixed if s.get("predicted_ms")]
    if predicted:
        over = sum(s["ms"] > s["predicted_ms"] for s in predicted)
        ratios = [s["ms"] / s["predicted_ms"] for s in predicted]
        lines.append(f"\nMixed steps measured over their prediction: {over:,} of {len(predicted):,}; "
                     f"measured / predicted median {median(ratios):.2f}, "
                     f"p90 {sorted(ratios)[int(0.9 * (len(ratios) - 1))]:.2f}")
    if steps and steps[-1].get("us_per_kv_token") is not None:
        last = steps[-1]
        lines.append(f"\nThe cost model at the window's end: {last['us_per_kv_token']:.5f} us a context "
                     f"token; the budget's guard {last.get('guard')}")
    if mixed:
        lines.append("\nSample mixed steps (" + ", ".join(PART_FIELDS) + "):")
        every = max(1, len(mixed) // num_samples)
        for s in mixed[::every][:num_samples]:
            lines.append("- " + ", ".join(f"{n} {s.get(n)}" for n in PART_FIELDS))
    return "\n".join(lines)


GRAMMAR_FIELDS = ("rows", "constrained_rows", "tokens", "predicted_ms", "ms", "fill_ms", "late_wait_ms")


def grammar_summary(steps: list[dict]) -> str:
    """Markdown: the medians of the steps with constrained rows (sampled late or not) against the
    steps without any."""
    kinds = (("with constrained rows, sampled late", [s for s in steps if s.get("constrained_rows")
                                                     and s.get("samples_late")]),
             ("with constrained rows, sampled at launch", [s for s in steps if s.get("constrained_rows")
                                                          and not s.get("samples_late")]),
             ("without", [s for s in steps if not s.get("constrained_rows")]))
    return "\n".join(_median_table(kinds, GRAMMAR_FIELDS))


def _median_table(kinds, fields: tuple[str, ...]) -> list[str]:
    """Markdown lines: a row of each (label, steps) with steps, its count and its fields' medians."""
    lines = ["| steps (medians) | count | " + " | ".join(fields) + " |",
             "| --- | ---: |" + " ---: |" * len(fields)]
    for label, kind in kinds:
        if kind:
            medians = " | ".join(_median(kind, name) for name in fields)
            lines.append(f"| {label} | {len(kind):,} | {medians} |")
    return lines


def main(argv: list[str]) -> None:
    steps = read_trace(Path(argv[0]))
    seconds = steps[-1]["t"] - steps[0]["t"] if len(steps) > 1 else 0.0
    print(f"{len(steps):,} steps over {seconds:.1f} s\n")
    print(mixed_summary(steps))
    print()
    print(grammar_summary(steps))


if __name__ == "__main__":
    main(sys.argv[1:])
