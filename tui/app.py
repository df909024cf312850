"""`dflash-local tui`: chat with a target/drafter pair and watch DFlash work, live.

The engine runs in a thread worker that only queues its events; a timer on the UI thread drains the queue every
FLUSH_S seconds, so the screen redraws a few times a second whatever the token rate, and the UI thread never waits
on the engine.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import dataclass
from typing import ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Input, Static

from dflash_local.chat.output import Stream, Syntax, syntax_for
from dflash_local.engine.engine import Finished, TextDelta
from dflash_local.engine.stats import StepStats

from .live import Live
from .panels import LivePanel, ModelPanel
from .settings import Settings, SettingsScreen

FLUSH_S = 0.1

# C0 controls (but newline and tab) and DEL would move the terminal's cursor: show them as their Unicode pictures
_CONTROLS = {c: 0x2400 + c for c in range(32) if c not in (9, 10)} | {127: 0x2421}


def printable(s: str) -> str:
    return s.translate(_CONTROLS)


@dataclass
class Done:
    """The worker's last word on one answer: the engine's generator is closed by the time this is queued."""

    error: Exception | None
    stopped: bool


class PromptInput(Input):
    """The prompt line; up and down recall earlier prompts."""

    BINDINGS: ClassVar = [Binding("up", "recall(-1)", show=False), Binding("down", "recall(1)", show=False)]

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sent: list[str] = []
        self.recall_at = 0

    def remember(self, text: str) -> None:
        self.sent.append(text)
        self.recall_at = len(self.sent)

    def action_recall(self, delta: int) -> None:
        if not self.sent:
            return
        self.recall_at = max(0, min(self.recall_at + delta, len(self.sent)))
        self.value = self.sent[self.recall_at] if self.recall_at < len(self.sent) else ""
        self.cursor_position = len(self.value)


class Message(Static):
    """One chat turn: a heading line, a thinking model's reasoning (folded: a click or ctrl+t unfolds it), then the
    text."""

    def __init__(self, role: str, heading: str, body: str = ""):
        super().__init__(classes=role)
        self.heading = heading
        self.body = body
        self.note = ""  # after the heading: the answer's figures, or why it ended early
        self.reasoning = ""
        self.reasoning_tokens = 0
        self.folded = True

    def on_mount(self) -> None:
        self.render_text()

    def on_click(self) -> None:
        self.toggle_reasoning()

    def toggle_reasoning(self) -> None:
        self.folded = not self.folded
        self.render_text()

    def render_text(self) -> None:
        t = Text()
        t.append(self.heading, style="bold")
        if self.note:
            t.append(" · " + self.note, style="dim")
        if self.reasoning:
            fold = "▸" if self.folded else "▾"
            t.append(f"\n{fold} Thinking · {self.reasoning_tokens} tokens", style="dim italic")
            if not self.folded:
                t.append("\n" + printable(self.reasoning), style="dim")
        t.append("\n" + (printable(self.body) or ("" if self.reasoning else "…")))
        self.update(t)


class ChatApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "dflash-local"
    ENABLE_COMMAND_PALETTE = False  # its footer entry would not fit in 80 columns beside ours
    BINDINGS: ClassVar = [
        Binding("enter", "send", "Send"),  # the prompt line takes enter first; this shows the key in the footer
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+b", "toggle_draft", "Draft on/off"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+y", "copy", "Copy answer"),
        Binding("ctrl+o", "settings", "Settings"),
        Binding("ctrl+t", "toggle_reasoning", "Thinking", show=False),  # the fold line says so; the footer is full
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, engine, settings: Settings | None = None, n_gpu_layers: int = 0):
        super().__init__()
        self.engine = engine
        self.info = engine.model_info()
        self.trained_block = self.info["drafter"]["trained_block_size"] if self.info["drafter"] else 1
        self.settings = settings or Settings(block_size=engine.block_size)
        self.n_gpu_layers = n_gpu_layers
        # what drafts: the DFlash drafter (n-gram drafts too, by default), or, with --spec-type ngram-simple, the
        # n-gram lookup alone
        self.spec = "DFlash" if engine.has_drafter else "n-gram" if engine.spec_types else None
        self.draft_next = self.spec is not None  # the mode of the next answer (ctrl+b)
        self.live = Live(drafting=self.draft_next)
        self.messages: list[dict] = []  # the conversation so far, as the engine takes it
        self.last_answer = ""
        self.busy = False  # from a prompt's send until its Done is drained
        self.answer: Message | None = None  # the answer being streamed
        self.reader = Stream(Syntax("think", separate=False, inline=True))  # reads the answer's reasoning apart from its text
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.stop_requested = threading.Event()

    def compose(self) -> ComposeResult:
        with Horizontal():
            with Vertical(id="chat-column"):
                with VerticalScroll(id="chat"):
                    yield Static(self.welcome(), id="welcome")
                yield PromptInput(placeholder="Ask something (enter sends)", id="prompt")
            with Vertical(id="side"):
                yield LivePanel(id="live")
                yield ModelPanel(id="model")
        yield Footer()

    def welcome(self) -> Text:
        t = Text("Type a prompt and press enter. ", style="dim")
        if self.spec:
            t.append(f"ctrl+b switches the next answer between {self.spec} and plain decoding, so the live panel "
                     "can measure the speedup.", style="dim")  # fmt: skip
        else:
            t.append("No drafter is loaded, so answers use plain decoding: start with --draft DRAFTER.gguf "
                     "(`dflash-local init-drafter` makes an untrained one) to see DFlash.", style="dim")  # fmt: skip
        return t

    def on_mount(self) -> None:
        self.query_one(PromptInput).focus()
        self.refresh_panels()
        self.set_interval(FLUSH_S, self.flush)

    def refresh_panels(self) -> None:
        self.query_one(LivePanel).show(self.live, self.spec)
        self.query_one(ModelPanel).show(self.info, self.settings.block_size, self.n_gpu_layers)
        self.query_one("#chat-column").border_title = "Chat · next: " + (self.spec if self.draft_next else "plain")

    # -- sending and streaming ------------------------------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.action_send()

    def action_send(self) -> None:
        prompt = self.query_one(PromptInput)
        text = prompt.value.strip()
        if not text:
            return
        if self.busy:
            self.notify("Still answering: esc stops it.", severity="warning")
            return
        prompt.remember(text)
        prompt.value = ""
        self.messages.append({"role": "user", "content": text})
        drafting = self.draft_next and self.spec is not None
        chat = self.query_one("#chat", VerticalScroll)
        self.answer = Message("assistant", self.spec if drafting else "plain")
        chat.mount(Message("user", "You", text))
        chat.mount(self.answer)
        chat.scroll_end(animate=False)
        self.live.start(drafting, self.settings.block_size)
        self.refresh_panels()
        self.busy = True
        self.stop_requested.clear()
        system = self.settings.system_prompt.strip()
        messages = ([{"role": "system", "content": system}] if system else []) + list(self.messages)
        # the block size bounds this answer's drafts (an argument of the generation: the engine keeps its own)
        kwargs = dict(messages=messages, draft=drafting, block_size=self.settings.block_size,
                      **self.settings.sampling())
        try:
            syntax = syntax_for(self.engine.chat_template, self.engine.chat_prompt(messages), "auto", None, None)
            kwargs["preserved_tokens"] = syntax.preserved
        except ValueError:  # the prompt cannot be made: the generation fails on the same error and says so
            syntax = Syntax("think", separate=False, inline=True)
        self.reader = Stream(syntax)
        self.run_worker(lambda: self.generate(kwargs), thread=True, group="generate")

    def generate(self, kwargs: dict) -> None:
        """Worker thread: run one answer, queueing every event; the UI thread does all the rest."""
        error, finished = None, False
        try:
            with contextlib.closing(self.engine.generate(**kwargs)) as events:
                for ev in events:
                    self.events.put(ev)
                    finished = isinstance(ev, Finished)
                    if self.stop_requested.is_set():
                        break  # closing the generator stops the engine cleanly between two steps
        except Exception as e:  # shown as a notification; the app carries on
            error = e
        self.events.put(Done(error, self.stop_requested.is_set() and not finished))

    def flush(self) -> None:
        """Timer: take whatever the worker queued since the last tick and redraw once."""
        text = stats = False
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                break
            if isinstance(ev, TextDelta):
                self.read(self.reader.feed(ev.text))
                self.live.first_text()
                text = True
            elif isinstance(ev, StepStats):
                self.live.step(ev)
                stats = True
            elif isinstance(ev, Finished):
                self.read(self.reader.close())
                self.live.finish(ev.summary)
                text = stats = True
            elif isinstance(ev, Done):
                self.done(ev)
                text = stats = True
        if text:
            self.answer.render_text()
            self.query_one("#chat", VerticalScroll).scroll_end(animate=False)
        if stats:
            self.refresh_panels()

    def read(self, deltas: list[dict]) -> None:
        for d in deltas:
            self.answer.body += d.get("content", "")
            if "reasoning_content" in d:
                self.answer.reasoning += d["reasoning_content"]
                # the reasoning's tokens, counted as the model's vocabulary spells it (no BOS)
                self.answer.reasoning_tokens = len(self.engine.target.tokenize(self.answer.reasoning, False, False))

    def done(self, ev: Done) -> None:
        self.busy = False
        s = self.live.summary
        if ev.error is not None:
            self.messages.pop()  # the question goes unanswered; keep the conversation sendable
            self.answer.note = "failed"
            name = type(ev.error).__name__
            self.notify(str(ev.error) or name, title=f"Generation failed ({name})", severity="error", timeout=8)
            return
        self.messages.append({"role": "assistant", "content": self.answer.body})
        self.last_answer = self.answer.body
        if ev.stopped:
            self.answer.note = f"stopped · {self.live.tokens} tokens"
        elif s is not None:
            self.answer.note = f"{s.n_generated} tokens · {s.tokens_per_second:.1f} tok/s"
            if s.drafting:
                self.answer.note += f" · τ {s.mean_acceptance_length:.2f}"
            if s.finish_reason == "length":
                self.answer.note += " · max tokens"
            elif s.finish_reason == "context_full":
                self.answer.note += " · context full"
                self.notify("The context is full: ctrl+n starts a new chat.", severity="warning")

    # -- keys -----------------------------------------------------------------------------------------------------

    def action_stop(self) -> None:
        if self.busy:
            self.stop_requested.set()

    def action_toggle_draft(self) -> None:
        if self.spec is None:
            self.notify("No drafter loaded: start with --draft DRAFTER.gguf.", severity="warning")
            return
        self.draft_next = not self.draft_next
        mode = f"{self.spec} drafting" if self.draft_next else "plain decoding (the baseline)"
        self.notify(f"Next answer: {mode}.")
        self.refresh_panels()

    def action_toggle_reasoning(self) -> None:
        if self.answer is not None:
            self.answer.toggle_reasoning()

    def action_new_chat(self) -> None:
        if self.busy:
            self.notify("Still answering: esc stops it first.", severity="warning")
            return
        self.messages.clear()
        chat = self.query_one("#chat", VerticalScroll)
        chat.remove_children(Message)
        self.answer = None
        self.query_one(PromptInput).focus()

    def action_copy(self) -> None:
        if not self.last_answer:
            self.notify("No answer to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(self.last_answer)  # OSC 52: the terminal must allow it
        self.notify(f"Copied the last answer ({len(self.last_answer)} characters).")

    def action_settings(self) -> None:
        self.push_screen(SettingsScreen(self.settings, self.trained_block), self.apply_settings)

    def apply_settings(self, settings: Settings | None) -> None:
        if settings is None:
            return
        self.settings = settings
        self.refresh_panels()
        self.notify("Settings saved: they apply from the next answer.")

    async def action_quit(self) -> None:
        self.stop_requested.set()  # the worker then ends after the current step instead of the whole answer
        self.exit()


def run(engine, n_gpu_layers: int = 0) -> int:
    """`dflash-local tui` on a loaded engine (the CLI loads it: the default pair without --model)."""
    engine.set_verbose(False)  # -v shows the loading log; during the app llama.cpp's log would tear the screen
    ChatApp(engine, n_gpu_layers=n_gpu_layers).run()
    return 0
