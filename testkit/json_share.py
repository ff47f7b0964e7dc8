"""The serving workload with and without a share of JSON-schema chats, side by side: the fleet's
results at each rate, plain and with `tokenfleet bench --json-share` (scripts/bench_serve_gpu.py
--json-share), and the ratios the JSON share costs (output, TTFT p50, ITL p50 and p99)."""

from __future__ import annotations

from dataclasses import dataclass

from testkit.runs import percentile


@dataclass
class RunFigures:
    """One streamed run's figures (seconds, tokens per second)."""

    tok_s: float
    ttft_p50: float
    itl_p50: float
    itl_p99: float
    num_json: int
    failed: int

    @classmethod
    def of(cls, results: list, json_indices: set[int]) -> RunFigures:
        """From `tokenfleet bench`'s Results; `json_indices`: the planned chats with a schema."""
        ok = [r for r in results if r.ok]
        first = min((r.started for r in results), default=0.0)
        last = max((r.finished for r in ok), default=first)
        ttft = [r.first_token - r.started for r in ok if r.first_token is not None]
        itl = [gap for r in ok for gap in r.gaps]
        return cls(sum(r.output_tokens for r in ok) / max(1e-9, last - first), percentile(ttft, 50),
                   percentile(itl, 50), percentile(itl, 99),
                   sum(r.index in json_indices for r in ok), len(results) - len(ok))


def json_share_table(share: float, rows: dict[float, tuple[RunFigures, RunFigures]]) -> str:
    """A markdown table: rate -> (plain, with the share)."""
    lines = [f"| req/s | output tok/s plain / {share:.0%} JSON (ratio) | TTFT p50 (ratio) | ITL p50 (ratio) "
             "| ITL p99 (ratio) | JSON chats done | failed plain / JSON |",
             "| ---: | --- | --- | --- | --- | ---: | --- |"]
    for rate, (plain, mixed) in rows.items():
        def ms(a: float, b: float) -> str:
            return f"{1e3 * a:,.1f} / {1e3 * b:,.1f} ms ({b / a:.2f}x)" if a > 0 else "-"

        ratio = mixed.tok_s / plain.tok_s if plain.tok_s else float("nan")
        lines.append(f"| {rate:g} | {plain.tok_s:,.0f} / {mixed.tok_s:,.0f} ({ratio:.2f}) "
                     f"| {ms(plain.ttft_p50, mixed.ttft_p50)} | {ms(plain.itl_p50, mixed.itl_p50)} "
                     f"| {ms(plain.itl_p99, mixed.itl_p99)} | {mixed.num_json} "
                     f"| {plain.failed} / {mixed.failed} |")
    return "\n".join(lines)
