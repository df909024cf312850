"""Run upstream llama.cpp's own converter class on a checkpoint, offline: the class upstream registers for the
checkpoint's architecture (DFlashModel or DSparkModel in conversion/qwen.py for drafters, to compare our converter's
output with what upstream writes; Qwen3_5TextModel for a Qwen3_5ForCausalLM target, a GGUF this project did not
write).

Usage: python upstream_convert.py LLAMA_CPP_SRC CHECKPOINT TARGET.gguf OUT.gguf

Runs in its own process: it imports the gguf-py vendored with that llama.cpp (which knows the dflash tensors), not
the installed one. transformers is stubbed (its AutoConfig fails, so upstream reads config.json itself), and
set_vocab copies the tokenizer.* keys from the target GGUF (for a target: any GGUF of ours with the vocabulary the
checkpoint was made for) instead of reading a Hugging Face tokenizer; a drafter's mask token is then written from
dflash_config as upstream's set_vocab does.
"""

import json
import sys
import types
from pathlib import Path

src, ckpt, target, out = (Path(a) for a in sys.argv[1:5])
sys.path[:0] = [str(src / "gguf-py"), str(src)]


class _AutoConfig:
    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise OSError("transformers is stubbed in this test")


sys.modules["transformers"] = types.SimpleNamespace(AutoConfig=_AutoConfig, __spec__=None)

import gguf  # noqa: E402  the vendored one
from conversion import get_model_class  # noqa: E402
from conversion.base import ModelType, get_model_architecture  # noqa: E402

assert Path(gguf.__file__).is_relative_to(src), gguf.__file__


def set_vocab(self):
    r = gguf.GGUFReader(str(target))
    for f in r.fields.values():
        if not f.name.startswith("tokenizer.") or f.name == "tokenizer.ggml.mask_token_id":
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            self.gguf_writer.add_key_value(f.name, f.contents(), vtype, f.types[1])
        else:
            self.gguf_writer.add_key_value(f.name, f.contents(), vtype)
    mask = self.hparams.get("dflash_config", {}).get("mask_token_id")
    if mask is not None:
        self.gguf_writer.add_mask_token_id(mask)


cls = get_model_class(get_model_architecture(json.loads((ckpt / "config.json").read_text()), ModelType.TEXT))
cls.set_vocab = set_vocab
model = cls(ckpt, gguf.LlamaFileType.ALL_F32, out, eager=True)
model.write()
