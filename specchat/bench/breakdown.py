"""`specchat bench --breakdown`: where a decoding cycle's time goes, per method.

A cycle (a plain step, or draft → verify → accept) is split into the kernel's products (the
target's linear layers and its LM head), attention, the rest of the target's forward (norms,
rotary, residuals, its calls between them), the draft steps, and the engine's bookkeeping (the
tree's mask and positions, acceptance, cache compaction, statistics: the cycle's wall time less
the forward and the drafting). The products and attention are timed inside the forward
(`Target.profiling`: the extension's clocks in `kernels/extension.cpp`, the LM head's around it);
a runtime without those clocks (transformers' forward, specchat's Python forward) gives the
forward as a whole. Figures are milliseconds per cycle, after each turn's prefill.
"""

from __future__ import annotations

from pathlib import Path

from specchat.stats import Stats

PARTS = {  # results.json key: what it counts
    "products": "the kernel's products",
    "attention": "attention",
    "forward_rest": "the rest of the target forward",
    "drafting": "drafting",
    "bookkeeping": "the engine's bookkeeping",
}


def cycle_breakdown(total: Stats, turns: int) -> dict | None:
    """Milliseconds per decoding cycle by part (`PARTS`), from a method's summed statistics over
    `turns` turns (one prefill each), or None where the forwards were not timed (other tools)."""
    cycles = total.target_forwards - turns
    if cycles <= 0 or total.forward_seconds <= 0:
        return None
    decoding = total.decoding_seconds
    timed = total.products_seconds > 0  # the forward's inside was timed

    def ms(seconds: float) -> float:
        return round(1000 * seconds / cycles, 3)

    return {
        "cycles": cycles, "cycle_ms": ms(decoding),
        "products": ms(total.products_seconds) if timed else None,
        "attention": ms(total.attention_seconds) if timed else None,
        "forward_rest": ms(total.forward_seconds - total.products_seconds - total.attention_seconds) if timed else None,
        "forward": ms(total.forward_seconds),
        "drafting": ms(total.draft_seconds),
        "bookkeeping": ms(decoding - total.forward_seconds - total.draft_seconds),
    }


def plot(plt, folder: Path, summary: dict) -> Path | None:
    """breakdown.png: a stacked bar per method (overall figures), or None where no method was timed."""
    methods = {method: categories["overall"]["breakdown"] for method, categories in summary.items()
               if (categories.get("overall") or {}).get("breakdown")}
    if not methods:
        return None
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(methods) + 2), 4))
    bottoms = [0.0] * len(methods)
    for part, label in PARTS.items():
        values = [numbers.get(part) or 0.0 for numbers in methods.values()]
        if part == "forward_rest" and not any(values):  # forwards timed only as a whole
            values, label = [numbers["forward"] for numbers in methods.values()], "the target forward"
        ax.bar(list(methods), values, bottom=bottoms, label=label)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_ylabel("milliseconds per decoding cycle")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = folder / "breakdown.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
