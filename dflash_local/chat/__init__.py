"""Text in and out of chat models, in pure Python: the chat templates (templates.py), streamed text (textstream.py:
whole UTF-8 characters, stop strings held back until decided), and what a model's output holds: reasoning, tool
calls and harmony channels (output.py parses them). It imports only the base modules; the engine and the frontends
import it. tests/test_layout.py checks it.
"""
