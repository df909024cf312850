"""The README's picture: drive the real app on a pair and save its screen as PNG (needs the screenshot extra).

python -m dflash_local.tui.screenshot docs/tui.png [-m target.gguf -d drafter.gguf] [--size 80x24] [-t threads]

(cairosvg: pip install "dflash-local[screenshot]"; and the DejaVu Sans Mono font, Debian's fonts-dejavu-core.)

It asks one question with DFlash and the same question plainly (in a new chat, so the prompt is the same), then
switches drafting back on, so the live panel shows a measured speedup.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import re
import sys
from pathlib import Path

from dflash_local.extras import MissingExtraError, needs_extra

PROMPT = "Write a Python function that checks whether a string is a palindrome."


# one run of text in the SVG that Textual (through Rich) writes
TEXT_RUN = re.compile(
    r'<text class="([^"]*)" x="([\d.]+)" y="([\d.]+)" textLength="([\d.]+)" clip-path="([^"]*)">([^<]*)</text>'
)


def svg_to_png(svg: str, out: Path) -> None:
    import cairosvg

    # The SVG asks for a web font (Fira Code) that cairo cannot fetch, and fits each run of text to its cells with
    # textLength, which cairo ignores: a local monospace font then drifts off the grid along a long run. So every
    # character gets its own cell.
    svg = svg.replace("font-family: Fira Code, monospace;", "font-family: DejaVu Sans Mono, monospace;")

    def cells(m: re.Match) -> str:
        cls, x, y, length, clip, text = m.groups()
        text = html.unescape(text)
        w = float(length) / max(len(text), 1)
        return "".join(
            f'<text class="{cls}" x="{float(x) + i * w:.1f}" y="{y}" textLength="{w:.1f}" clip-path="{clip}">'
            f"{html.escape(c)}</text>"
            for i, c in enumerate(text)
            if c.strip()  # blanks draw nothing: cell backgrounds are rectangles of their own
        )

    cairosvg.svg2png(bytestring=TEXT_RUN.sub(cells, svg).encode(), write_to=str(out), output_width=1600)


async def shoot(app, out: Path, size: tuple[int, int], prompt: str, max_tokens: int) -> None:
    async def answer() -> None:
        await pilot.press(*prompt, "enter")
        while app.busy:
            await pilot.pause(0.05)

    app.settings.max_tokens = max_tokens
    async with app.run_test(size=size) as pilot:
        await answer()  # DFlash (or plain, without a drafter)
        if app.engine.has_drafter:
            await pilot.press("ctrl+n", "ctrl+b")
            await answer()  # the baseline
            await pilot.press("ctrl+n", "ctrl+b")
            await answer()
        await pilot.pause(0.5)  # let notifications time out
        svg = app.export_screenshot(title="dflash-local tui")
    if out.suffix == ".svg":
        out.write_text(svg)
    else:
        svg_to_png(svg, out)


def main(argv: list[str] | None = None) -> int:
    from dflash_local import models
    from dflash_local.engine.engine import Engine

    from .app import ChatApp

    p = argparse.ArgumentParser(prog="python -m dflash_local.tui.screenshot")
    p.add_argument("output", type=Path, help="PNG to write (or SVG, by its suffix)")
    p.add_argument("-m", "--model", help="target GGUF or a built-in pair's name (default: the default pair)")
    p.add_argument("-d", "--draft", help="drafter GGUF (default: a built-in pair's shipped drafter)")
    p.add_argument("-p", "--prompt", default=PROMPT)
    p.add_argument("-n", "--max-tokens", type=int, default=96)
    p.add_argument("-t", "--threads", type=int)
    p.add_argument("--size", default="80x24", help="terminal columns x rows")
    args = p.parse_args(argv)
    if args.output.suffix != ".svg":
        try:
            with needs_extra("screenshot", "a PNG screenshot"):
                import cairosvg  # noqa: F401  (checked before the run, used at its end)
        except MissingExtraError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    cols, rows = (int(x) for x in args.size.split("x"))
    engine = Engine(*models.pair(args.model, args.draft), n_ctx=4096, n_threads=args.threads)
    app = ChatApp(engine)
    asyncio.run(shoot(app, args.output, (cols, rows), args.prompt, args.max_tokens))
    print(args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
