"""The side panels: live figures and the loaded models. Their text is built by plain functions of plain data."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from .live import Live

WIDTH = 28  # the panels' text width: a 32-column side column less border and padding (see app.tcss)
LEVELS = " ▁▂▃▄▅▆▇█"


def clip(s: str, width: int) -> str:
    return s if len(s) <= width else s[: width - 1] + "…"


def position_bars(rates: list[float], width: int) -> tuple[str, str, str]:
    """A two-row bar chart of acceptance rates (0..1), one column per draft position, and its axis labels."""
    n = len(rates)
    col = max(1, min(3, width // max(n, 1)))
    bar = max(col - 1, 1)  # a gap between columns where there is room for one
    top, bottom, axis = "", "", ""
    for k, r in enumerate(rates, start=1):
        h = round(max(0.0, min(r, 1.0)) * 16)  # in eighths of a row, two rows
        top += LEVELS[max(h - 8, 0)] * bar + " " * (col - bar)
        bottom += (LEVELS[min(h, 8)] if h else "·") * bar + " " * (col - bar)  # a dot: nothing accepted there
        axis += (str(k) if col > 1 else str(k % 10)).ljust(col)
    return top, bottom, axis


def share_bar(parts: list[tuple[float, str]], width: int) -> Text:
    """One line split between parts (value, style) in proportion to their values."""
    total = sum(v for v, _ in parts)
    text = Text()
    if total <= 0:
        return Text("░" * width, style="dim")
    used = 0
    for i, (v, style) in enumerate(parts):
        n = width - used if i == len(parts) - 1 else min(round(width * v / total), width - used)
        text.append("█" * n, style=style)
        used += n
    return text


def ms(v: float) -> str:
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def rates_text(live: Live) -> Text:
    return Text.assemble(
        ("now ", "dim"), (f"{live.now_tps:6.1f}", "bold"), (" tok/s", "dim"),
        ("  avg ", "dim"), (f"{live.avg_tps:.1f}", "bold"),
    )  # fmt: skip


def details_text(live: Live, spec: str | None) -> Text:
    """Lines of at most WIDTH columns (longer ones are cut by the panel's CSS)."""
    t = Text()
    t.append("tokens ", "dim").append(f"{live.tokens:<6d}")
    t.append("accept len ", "dim").append(f"{live.tau:.2f}\n", "bold")
    if live.drafting and live.steps:
        top, bottom, axis = position_bars(live.acceptance, WIDTH - 7)
        t.append("accept ", "dim").append(top, "green").append("\n")
        t.append("rate   ", "dim").append(bottom, "green").append("\n")
        t.append("@pos   ", "dim").append(axis, "dim").append("\n")
    else:
        why = "" if live.drafting else " plain decoding" if spec else " no drafter"
        t.append("accept ", "dim").append(f"—{why}\n\n\n", "dim")
    t.append("draft ", "dim").append(ms(live.draft_ms), "magenta").append(" · ", "dim")
    t.append("verify ", "dim").append(ms(live.verify_ms), "cyan").append(" ms\n", "dim")
    t.append_text(share_bar([(live.draft_ms, "magenta"), (live.verify_ms, "cyan"), (live.other_ms, "grey50")], WIDTH))
    t.append("\nprompt ", "dim")
    if live.prompt_tps is None:
        t.append("—", "dim")
    else:
        t.append(f"{live.prompt_tps:.0f}").append(f" tok/s ({live.prompt_new} tok)", "dim")
    t.append("\nspeedup ", "dim")
    if live.speedup is not None:
        t.append(f"{live.speedup:.2f}×", "bold green" if live.speedup >= 1 else "bold red")
        t.append(f" {live.dflash.tokens_per_second:.0f}/{live.plain.tokens_per_second:.0f} tok/s", "dim")
    elif not spec:
        t.append("needs a drafter", "dim")
    elif live.plain.ms <= 0:
        t.append("needs a plain answer", "dim")  # ^b in the footer; the welcome text says how
    else:
        t.append("needs a DFlash answer", "dim")
    return t


class LivePanel(Vertical):
    def compose(self) -> ComposeResult:
        yield Static(id="rates")
        yield Sparkline([], id="spark")
        yield Static(id="details")

    def show(self, live: Live, spec: str | None) -> None:
        """spec: what drafts ("DFlash" or "n-gram"), None for plain decoding only."""
        self.border_title = "Live · " + (spec if live.drafting and spec else "plain")
        self.query_one("#rates", Static).update(rates_text(live))
        self.query_one("#spark", Sparkline).data = list(live.history)
        self.query_one("#details", Static).update(details_text(live, spec))


def devices(info: dict, n_gpu_layers: int) -> str:
    """Where the layers run, in the 20 columns left on the panel's line."""
    if n_gpu_layers == 0:
        n = info["n_threads"]
        return f"CPU {n} thread" + ("s" if n != 1 else "")
    if not info["gpu_offload"]:
        return "CPU (no GPU build)"  # llama.cpp was built without CUDA/Metal: -ngl has no effect
    return "GPU all layers" if n_gpu_layers < 0 else f"GPU {n_gpu_layers} layers + CPU"


def model_text(info: dict, block_size: int, n_gpu_layers: int) -> Text:
    t = Text()
    tg = info["target"]
    t.append("target  ", "dim").append(clip(Path(tg["path"]).name, WIDTH - 8), "bold").append("\n")
    t.append(f"  {tg['arch']} {tg['quant']} {tg['size_bytes'] / 2**20:.0f} MiB\n")
    d = info["drafter"]
    if d is None:
        t.append("drafter ", "dim").append("none: plain only\n", "yellow")
        t.append("  start with -d DRAFTER.gguf\n", "dim")
    else:
        t.append("drafter ", "dim").append(clip(Path(d["path"]).name, WIDTH - 8), "bold").append("\n")
        t.append(f"  {d['arch']} {d['quant']} {d['size_bytes'] / 2**20:.0f} MiB\n")
    t.append("device  ", "dim").append(devices(info, n_gpu_layers) + "\n")
    t.append("context ", "dim").append(f"{info['n_ctx']}")
    trained = d["trained_block_size"] if d else 1
    t.append("  block ", "dim").append(f"{block_size}").append(f"/{trained}\n", "dim")
    # whether greedy DFlash output is guaranteed token-identical to plain decoding (docs/lossless.md)
    t.append("verify  ", "dim").append("bit-exact" if info["bit_exact_verify"] else "not bit-exact")
    if "placement" in info:
        t.append("\n").append(placement_text(info))
    return t


def placement_text(info: dict) -> Text:
    """What is where: GPU layers, experts kept on the CPU, KV types, memory per buffer type."""
    p, t = info["placement"], Text()
    if p["gpu_devices"]:
        t.append("gpu     ", "dim").append(f"{p['target_layers_on_gpu']}/{p['target_layer_slots']} layers\n")
    if p["n_expert"] and p["overrides"]:
        n_layer = info["target"]["n_layer"]
        moe = f"CPU in {min(p['n_cpu_moe'], n_layer)}/{n_layer} layers" if p["n_cpu_moe"] else "placed by -ot"
        t.append("experts ", "dim").append(moe + "\n")
    elif p["overrides"]:
        t.append("-ot     ", "dim").append(f"{len(p['overrides'])} pattern(s)\n")
    t.append("kv      ", "dim").append(f"{p['cache_type_k']}/{p['cache_type_v']}")
    if info["drafter"]:
        t.append(" draft ", "dim").append(f"{p['cache_type_k_draft']}/{p['cache_type_v_draft']}")
    t.append(" fa ", "dim").append(p["flash_attn"] + "\n")
    totals: dict[str, int] = {}
    for row in info["memory"]["target"] + info["memory"]["drafter"]:
        totals[row["buffer_type"]] = totals.get(row["buffer_type"], 0) + row["model"] + row["context"] + row["compute"]
    t.append("memory", "dim")  # weights, KV caches and compute buffers of both contexts, per buffer type
    for name, b in sorted(totals.items()):
        if b:
            t.append(f"\n  {clip(name, 14):<14} {b / 2**20:7.1f} MiB")
    return t


class ModelPanel(Static):
    def show(self, info: dict, block_size: int, n_gpu_layers: int) -> None:
        self.border_title = "Model"
        self.update(model_text(info, block_size, n_gpu_layers))
