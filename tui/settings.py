"""Generation settings and the screen that edits them."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Input, Label, Static

from dflash_local.engine.sampling import MAX_TEMPERATURE


@dataclass
class Settings:
    temperature: float = 0.0  # 0: greedy, where DFlash output is token-identical to plain decoding
    top_p: float = 1.0
    max_tokens: int = 512
    block_size: int = 1  # the draft length per step is block_size - 1; at most the drafter's trained size
    system_prompt: str = ""

    def sampling(self) -> dict:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p}


LABELS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "max_tokens": "max tokens",
    "block_size": "block size",
    "system_prompt": "system prompt",
}


def parse(values: dict[str, str], base: Settings, max_block: int) -> Settings:
    """Settings from the screen's text fields; ValueError says which field is wrong and why."""

    def number(name, kind, ok, why):
        try:
            v = kind(values[name].strip())
        except ValueError:
            raise ValueError(f"{LABELS[name]}: {values[name]!r} is not a {'whole ' if kind is int else ''}number")
        if not ok(v):
            raise ValueError(f"{LABELS[name]}: {why}")
        return v

    return replace(
        base,
        temperature=number("temperature", float, lambda v: 0 <= v <= MAX_TEMPERATURE,
                           f"between 0 and {MAX_TEMPERATURE:g}"),
        top_p=number("top_p", float, lambda v: 0 < v <= 1, "above 0, at most 1"),
        max_tokens=number("max_tokens", int, lambda v: v >= 1, "at least 1"),
        block_size=number("block_size", int, lambda v: 1 <= v <= max_block, f"from 1 to {max_block}"),
        system_prompt=values["system_prompt"],
    )


class SettingsScreen(ModalScreen[Settings | None]):
    """Dismisses with the new Settings (enter or Save) or None (escape or Cancel)."""

    BINDINGS: ClassVar = [Binding("escape", "cancel", "Cancel"), Binding("enter", "save", "Save")]

    def __init__(self, settings: Settings, max_block: int):
        super().__init__()
        self.settings = settings
        self.max_block = max_block

    def compose(self) -> ComposeResult:
        with Vertical(id="settings"):
            for f in fields(Settings):
                with Horizontal(classes="field"):
                    yield Label(LABELS[f.name])
                    yield Input(str(getattr(self.settings, f.name)), id=f.name)
            if self.max_block > 1:
                policy = f"Block size 1 to {self.max_block} (the drafter's): a step drafts block size - 1 tokens."
            else:
                policy = "Block size 1: no drafter is loaded."
            yield Static(policy + " Temperature 0 is greedy. enter saves, esc cancels.", classes="hint")
            with Horizontal(id="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#settings").border_title = "Settings"

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_save() if event.button.id == "save" else self.action_cancel()

    def action_save(self) -> None:
        values = {f.name: self.query_one(f"#{f.name}", Input).value for f in fields(Settings)}
        try:
            self.dismiss(parse(values, self.settings, self.max_block))
        except ValueError as e:
            self.notify(str(e), title="Not saved", severity="error")

    def action_cancel(self) -> None:
        self.dismiss(None)
