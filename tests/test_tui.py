"""The Textual TUI, driven by Pilot on the real app: the tiny engine for behaviour, scripted events for the picture."""

import asyncio
import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest
from planted import PlantedEngine, cut

from dflash_local import Engine, Finished, StepStats, TextDelta
from dflash_local.chat.templates import read_template
from dflash_local.engine.stats import StatsTracker
from dflash_local.tui.app import ChatApp, Message
from dflash_local.tui.panels import LivePanel, ModelPanel, devices, position_bars
from dflash_local.tui.settings import Settings, SettingsScreen

QWEN35 = read_template(Path(__file__).parent / "templates" / "qwen35-like.jinja")

SIZE = (80, 24)
PROMPT = "def sum(x):"


@pytest.fixture()
def engine(tiny_target, tiny_drafter):
    # a fresh engine per test: an answer still finishing when one test's app closes must not find the next test's
    # engine busy
    return Engine(tiny_target, tiny_drafter, n_ctx=1024, draft_policy="fixed")


class Paced:
    """The real engine with a pause after every event, so that a test can watch an answer arrive and stop it."""

    def __init__(self, engine, pause_s: float):
        self.engine, self.pause_s, self.calls, self.closed = engine, pause_s, [], 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, **kw):
        self.calls.append(kw)
        try:
            with contextlib.closing(self.engine.generate(**kw)) as events:
                for ev in events:
                    time.sleep(self.pause_s)
                    yield ev
        except GeneratorExit:
            self.closed += 1
            raise


async def settle(pilot, app, timeout: float = 60.0) -> None:
    """Wait until the answer in flight is done and drawn."""
    deadline = time.monotonic() + timeout
    while app.busy:
        assert time.monotonic() < deadline, "the answer did not finish"
        await pilot.pause(0.02)
    await pilot.pause()


async def ask(pilot, app, text: str = PROMPT) -> None:
    app.query_one("#prompt").value = text  # typing is tested once, in the first test; here it would only be slow
    await pilot.press("enter")
    await settle(pilot, app)


def text_of(widget) -> str:
    return str(widget.content)


def details(app) -> str:
    return text_of(app.query_one(LivePanel).query_one("#details"))


def notes(app) -> list:
    return list(app._notifications)


def run(coro):
    return asyncio.run(coro)


def test_chat_streams_in_batches_and_updates_the_stats(engine, monkeypatch):
    paced = Paced(engine, 0.002)
    renders, panels = [], []  # every redraw of the answer and of the live panel, with what it showed
    draw, show = Message.render_text, LivePanel.show

    def drawn(message):
        if message.has_class("assistant"):
            renders.append(message.body)
        draw(message)

    def shown(panel, live, has_drafter):
        panels.append(live.tokens)
        show(panel, live, has_drafter)

    monkeypatch.setattr(Message, "render_text", drawn)
    monkeypatch.setattr(LivePanel, "show", shown)
    expected = engine.complete(messages=[{"role": "user", "content": PROMPT}], max_tokens=120)

    async def main():
        app = ChatApp(paced, Settings(max_tokens=120, block_size=engine.block_size))
        async with app.run_test(size=SIZE) as pilot:
            assert app.focused is app.query_one("#prompt")
            await pilot.press(*PROMPT, "enter")
            await settle(pilot, app)

            answer = app.answer
            assert answer.body == expected.text  # greedy: exactly what the engine makes on its own
            partial = [r for r in renders if r and r != expected.text]  # what was drawn while it was made
            assert partial and all(expected.text.startswith(r) for r in partial), "no partial answer was shown"
            n_deltas = sum(isinstance(ev, TextDelta) for ev in engine.generate(
                messages=[{"role": "user", "content": PROMPT}], max_tokens=120))  # fmt: skip
            assert len(partial) < n_deltas  # redrawn on the timer, not per token
            assert app.messages == [
                {"role": "user", "content": PROMPT},
                {"role": "assistant", "content": expected.text},
            ]

            s = app.live.summary
            assert s.drafting and s.n_generated == expected.summary.n_generated == app.live.tokens
            assert any(0 < n < s.n_generated for n in panels)  # the figures moved while the answer came
            assert app.live.steps == s.steps > 0
            assert app.live.tau == pytest.approx(s.mean_acceptance_length)
            assert len(app.live.acceptance) == engine.block_size - 1
            assert len(app.live.history) == s.steps  # one sparkline sample per step
            shown = details(app)
            assert f"tokens {s.n_generated}" in shown
            assert f"accept len {s.mean_acceptance_length:.2f}" in shown
            assert f"prompt {s.prompt_tokens_per_second:.0f} tok/s" in shown
            assert f"{s.tokens_per_second:.1f} tok/s" in answer.note
            assert app.query_one(LivePanel).border_title == "Live · DFlash"

            await pilot.press("ctrl+y")
            assert app.clipboard == expected.text
            await pilot.press("up")  # the prompt line recalls the last prompt
            assert app.query_one("#prompt").value == PROMPT

            await pilot.press("ctrl+n")
            assert app.messages == [] and not app.query(Message)

    run(main())


def test_stop_key_ends_the_answer_and_the_engine_is_free_again(engine):
    paced = Paced(engine, 0.02)

    async def main():
        app = ChatApp(paced, Settings(max_tokens=500, block_size=engine.block_size))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press(*PROMPT, "enter")
            deadline = time.monotonic() + 30
            while not app.answer.body and time.monotonic() < deadline:
                await pilot.pause(0.02)
            assert app.busy, "the answer ended before the stop key"
            await pilot.press("escape")
            await settle(pilot, app, timeout=10)
            assert paced.closed == 1  # the engine's generator was closed, not run out
            assert app.answer.note.startswith("stopped")
            assert 0 < app.live.tokens < 500
            assert app.live.summary is None
            assert app.messages[-1] == {"role": "assistant", "content": app.answer.body}  # kept in the chat

            # the engine is not left busy: the next answer runs to its end
            app.settings.max_tokens = 8
            paced.pause_s = 0
            await ask(pilot, app, "more")
            assert app.live.summary.n_generated == 8 and app.answer.note.endswith("max tokens")

    run(main())


def test_toggling_drafting_measures_the_speedup(engine):
    async def main():
        app = ChatApp(engine, Settings(max_tokens=40, block_size=engine.block_size))
        async with app.run_test(size=SIZE) as pilot:
            await ask(pilot, app)
            dflash = app.answer.body
            assert app.live.summary.drafting
            assert app.live.speedup is None and "speedup needs a plain answer" in details(app)

            await pilot.press("ctrl+n", "ctrl+b")
            assert not app.draft_next and "next: plain" in app.query_one("#chat-column").border_title
            await ask(pilot, app)
            s = app.live.summary
            assert not s.drafting and s.steps == s.n_generated - 1  # one token per step: no drafts
            assert app.answer.body == dflash  # lossless: greedy DFlash and plain decoding agree
            assert app.query_one(LivePanel).border_title == "Live · plain"
            assert "plain decoding" in details(app)

            live = app.live
            assert live.dflash.answers == 1 and live.plain.answers == 1
            assert live.speedup == pytest.approx(live.dflash.tokens_per_second / live.plain.tokens_per_second)
            assert f"speedup {live.speedup:.2f}×" in details(app)

            await pilot.press("ctrl+b")
            assert app.draft_next

    run(main())


def test_without_a_drafter_the_panels_say_so(tiny_target):
    plain = Engine(tiny_target, n_ctx=256)

    async def main():
        app = ChatApp(plain)
        async with app.run_test(size=SIZE) as pilot:
            model = text_of(app.query_one(ModelPanel))
            assert "none: plain only" in model and "-d DRAFTER.gguf" in model
            await pilot.press("ctrl+b")
            assert not app.draft_next
            assert any("No drafter loaded" in n.message for n in notes(app))
            app.settings.max_tokens = 5
            await ask(pilot, app)
            assert not app.live.summary.drafting and "needs a drafter" in details(app)

    run(main())


def test_ngram_drafts_alone_are_a_drafting_mode(gemma_target):
    from dflash_local.engine.ngram import NgramSpec

    e = Engine(gemma_target, n_ctx=1024, ngram=NgramSpec())  # --spec-type ngram-simple: no drafter

    async def main():
        app = ChatApp(e)
        async with app.run_test(size=SIZE) as pilot:
            assert app.draft_next and "between n-gram and plain decoding" in text_of(app.query_one("#welcome"))
            app.settings.max_tokens = 48
            await ask(pilot, app, "Repeat after me three times: the cat sat on the mat.")
            assert app.live.summary.drafting and app.query_one(LivePanel).border_title == "Live · n-gram"
            assert app.answer.heading == "n-gram"
            await pilot.press("ctrl+b")
            assert not app.draft_next and any("plain decoding" in n.message for n in notes(app))

    run(main())


def test_settings_apply_to_the_next_answer(engine):
    paced = Paced(engine, 0)

    async def main():
        app = ChatApp(paced, Settings(block_size=engine.block_size))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("ctrl+o")
            assert isinstance(app.screen, SettingsScreen)
            assert app.focused.id == "temperature"

            async def fill(value):  # the focused field: clear it, type, next field
                await pilot.press("end", "ctrl+u", *value, "tab")

            await fill("0")
            await fill("0.9")
            await fill("abc")
            await pilot.press("enter")  # refused: max tokens is no number
            assert isinstance(app.screen, SettingsScreen)
            assert any("max tokens" in n.message and n.severity == "error" for n in notes(app))

            app.screen.query_one("#max_tokens").focus()
            await fill("7")
            await fill("3")
            await pilot.press(*"Answer in Python.")
            await pilot.press("enter")
            assert not isinstance(app.screen, SettingsScreen)
            assert app.settings == Settings(0.0, 0.9, 7, 3, "Answer in Python.")
            assert "block 3/8" in text_of(app.query_one(ModelPanel))

            await ask(pilot, app)
            kw = paced.calls[-1]
            assert kw["messages"][0] == {"role": "system", "content": "Answer in Python."}
            assert kw["top_p"] == 0.9 and kw["max_tokens"] == 7 and kw["block_size"] == 3
            s = app.live.summary
            assert s.n_generated == 7
            # block 3: the engine drafted at most two tokens a step (full blocks, with the fixed policy), and
            # counted two draft positions
            assert max(step.n_drafted for step in app.live.tracker.steps) == 2
            assert len(s.drafted_at) == len(app.live.acceptance) == 2
            assert engine.block_size == 8  # the engine's own default is left as it was

            await pilot.press("ctrl+o", "end", *"5", "escape")  # escape: nothing changes
            assert app.settings.temperature == 0.0

    run(main())


class Scripted:
    """An engine stand-in that plays scripted answers: deterministic figures for the picture, and failures."""

    has_drafter = True
    chat_template = None

    def __init__(self, *answers):
        self.answers = list(answers)
        self.block_size = 4

    def chat_prompt(self, messages, chat_template_kwargs=None) -> str:
        return ""

    def model_info(self) -> dict:
        return {
            "target": {"path": "/models/gemma-3-270m-q4_k_m.gguf", "arch": "gemma3", "quant": "Q4_K_M",
                       "size_bytes": 253_000_000},
            "drafter": {"path": "/models/gemma-3-270m-dflash.gguf", "arch": "dflash", "quant": "F16",
                        "size_bytes": 25_000_000, "n_layer": 1, "target_layers": [1, 9, 16], "trained_block_size": 4},
            "n_ctx": 4096, "n_threads": 2, "block_size": 4, "feature_capture": "callback",
            "bit_exact_verify": True, "gpu_offload": False,
        }  # fmt: skip

    def generate(self, **kw):
        yield from self.answers.pop(0)(kw["draft"])


def scripted_answer(text: str, accepted: list[int] | None = None):
    """Words as tokens; with drafting, step i accepts accepted[i] of 3 drafts."""

    def events(draft):
        words = [w + " " for w in text.split()]
        tracker = StatsTracker(4 if draft else 1)
        yield TextDelta(words[0])
        i, k = 1, 0
        while i < len(words):
            n_acc = accepted[k % len(accepted)] if draft else 0
            s = StepStats(k, 3 if draft else 0, n_acc, min(n_acc + 1, len(words) - i), 1.5 if draft else 0.0,
                          24.0 if draft else 14.0, 0.4)  # fmt: skip
            tracker.add(s)
            yield TextDelta("".join(words[i : i + s.n_tokens]))
            yield s
            i, k = i + s.n_tokens, k + 1
        summary = tracker.summary(finish_reason="eos", drafting=draft, n_prompt=16, n_cached=0,
                                  n_generated=len(words), prompt_ms=40.0)  # fmt: skip
        yield Finished("".join(words), list(range(len(words))), summary)

    return events


def fails_midway(draft):
    yield TextDelta("The tide")
    raise RuntimeError("llama_decode failed: -3")


POEM = (
    "The sea rolls in with silver light, it folds the sand and sings all night; the gulls ride high on salt and "
    "foam, and every wave comes rolling home."
)


def test_an_engine_error_is_a_notification_and_the_app_goes_on():
    fake = Scripted(fails_midway, scripted_answer("Calm water.", [1]))

    async def main():
        app = ChatApp(fake)
        async with app.run_test(size=SIZE) as pilot:
            await ask(pilot, app, "a poem")
            [note] = notes(app)
            assert note.severity == "error" and "llama_decode failed: -3" in note.message
            assert "RuntimeError" in note.title
            assert app.answer.note == "failed" and app.messages == []  # the question can be asked again
            await ask(pilot, app, "a poem")
            assert app.answer.body == "Calm water. "
            assert app.messages[-1]["content"] == "Calm water. "

    run(main())


def test_a_prompt_too_long_for_the_context_is_a_notification(engine):
    async def main():
        app = ChatApp(engine)
        async with app.run_test(size=SIZE) as pilot:
            prompt = app.query_one("#prompt")
            prompt.value = " ".join(f"w{i}" for i in range(2000))
            await pilot.press("enter")
            await settle(pilot, app)
            assert any("ContextOverflowError" in n.title for n in notes(app))
            assert app.is_running and not app.busy
            app.settings.max_tokens = 4
            await ask(pilot, app, "short")  # the chat goes on
            assert app.live.summary.n_generated == 4

    run(main())


def test_reasoning_is_folded_above_the_answer_with_its_token_count(tiny_target):
    """A thinking model's answer (planted at the engine boundary: the tiny model does not think): the reasoning is
    one folded line with its token count, ctrl+t unfolds it, and the conversation keeps only the answer."""
    engine = PlantedEngine(Engine(tiny_target, n_ctx=1024, chat_template=QWEN35))
    engine.pieces = cut("Let me think.\nThe sum of x.\n</think>\n\nsum(x) adds them.", 3)
    reasoning = "Let me think.\nThe sum of x."

    async def main():
        app = ChatApp(engine, Settings(max_tokens=8, block_size=1))
        async with app.run_test(size=SIZE) as pilot:
            await ask(pilot, app)
            answer = app.answer
            assert (answer.reasoning, answer.body) == (reasoning, "sum(x) adds them.")
            n = len(engine.target.tokenize(reasoning, False, False))
            assert answer.reasoning_tokens == n > 3
            shown = text_of(answer)
            assert f"▸ Thinking · {n} tokens" in shown and "Let me think" not in shown
            assert shown.endswith("\nsum(x) adds them.")
            await pilot.press("ctrl+t")
            assert f"▾ Thinking · {n} tokens\n{reasoning}\nsum(x) adds them." in text_of(answer)
            await pilot.click("Message.assistant", offset=(4, 1))  # a click folds it again
            assert "Let me think" not in text_of(answer)
            assert app.messages[-1] == {"role": "assistant", "content": "sum(x) adds them."}
            assert "<think>" in set(engine.preserved)

    run(main())


def test_the_default_pair_answers_a_question_on_the_first_screen():
    """What `bash scripts/demo.sh` opens: SmolLM2 with its shipped drafter answers a coding question with code, drafted
    and token-identical to the same answer decoded plainly."""
    from dflash_local import models

    engine = Engine(models.default_target(), models.default_drafter(), n_ctx=2048)
    question = "Write a Python function that checks whether a string is a palindrome."
    plain = engine.complete(messages=[{"role": "user", "content": question}], max_tokens=96, draft=False)

    async def main():
        app = ChatApp(engine, Settings(max_tokens=96, block_size=engine.block_size))
        async with app.run_test(size=SIZE) as pilot:
            await ask(pilot, app, question)
            assert app.answer.body == plain.text
            assert "def " in plain.text and "palindrome" in plain.text.lower()
            assert app.live.summary.drafting and app.query_one(LivePanel).border_title == "Live · DFlash"

    run(main())


def test_gemma_thinking_in_the_tui(gemma_target, gemma_drafter):
    """The real generation: with the qwen35-like template the prompt opens <think>, so gemma's words are reasoning."""
    engine = Engine(gemma_target, gemma_drafter, n_ctx=1024, chat_template=QWEN35)

    async def main():
        app = ChatApp(engine, Settings(max_tokens=16, block_size=engine.block_size))
        async with app.run_test(size=SIZE) as pilot:
            await ask(pilot, app, "Say hello.")
            want = engine.complete(messages=[{"role": "user", "content": "Say hello."}], max_tokens=16)
            assert "</think>" not in want.text  # greedy gemma never closes the block within 16 tokens
            assert app.answer.reasoning == want.text.strip() and app.answer.body == ""
            assert app.answer.reasoning_tokens > 0 and "Thinking ·" in text_of(app.answer)

    run(main())


def test_acceptance_bars():
    top, bottom, axis = position_bars([1.0, 0.5, 0.0], 21)  # two rows of eighths; a dot for nothing accepted
    assert (top, bottom, axis) == ("██       ", "██ ██ ·· ", "1  2  3  ")
    top, bottom, axis = position_bars([0.25] * 15, 21)  # a block of 16: one column each
    assert len(bottom) == 15 and set(bottom) == {"▄"} and axis == "123456789012345"


def test_model_panel_devices():
    info = Scripted().model_info()
    assert devices(info, 0) == "CPU 2 threads"
    assert devices(info, -1) == "CPU (no GPU build)"
    assert devices(info | {"gpu_offload": True}, -1) == "GPU all layers"
    assert devices(info | {"gpu_offload": True}, 10) == "GPU 10 layers + CPU"


def test_tui_command_reports_a_bad_model_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    r = subprocess.run([sys.executable, "-m", "dflash_local", "tui", "-m", str(bad)], capture_output=True, text=True,
                       cwd=tmp_path, timeout=60)
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1].startswith("dflash-local: error:") and "Traceback" not in r.stderr


def test_main_screen_snapshot(snap_compare):
    """The main screen at 80x24 after a DFlash answer and a plain one (scripted, so the figures are fixed)."""
    fake = Scripted(scripted_answer(POEM, [3, 2, 1, 3, 0]), scripted_answer(POEM))

    async def run_before(pilot):
        app = pilot.app
        await ask(pilot, app, "Write a short poem about the sea.")
        await pilot.press("ctrl+n", "ctrl+b")
        await ask(pilot, app, "Write a short poem about the sea.")
        await pilot.press("ctrl+n", "ctrl+b")
        fake.answers.append(scripted_answer(POEM, [3, 2, 1, 3, 0]))
        await ask(pilot, app, "Write a short poem about the sea.")
        app.clear_notifications()
        await pilot.pause()

    assert snap_compare(ChatApp(fake), terminal_size=SIZE, run_before=run_before)
