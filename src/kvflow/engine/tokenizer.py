"""Text <-> token ids for the engine (stop strings) and the server (text prompts, chat).

A checkpoint directory with tokenizer files uses its own tokenizer and chat template. Anything else (the random-
weight presets) uses the byte-level fallback, so every model serves text:

    encode: the UTF-8 bytes of the text, one token per byte (ids 0..255; needs vocab_size >= 256)
    decode: ids 0..255 are bytes (invalid UTF-8 becomes U+FFFD); an id >= 256 is written as "<|id|>"
    chat  : "<|role|>\\n" + content + "\\n" for each message, then "<|assistant|>\\n"
"""

from __future__ import annotations

from pathlib import Path

from kvflow.errors import ModelError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class ByteTokenizer:
    kind = "bytes"

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ModelError(f"the byte-level tokenizer needs vocab_size >= 256 (model has {vocab_size})")
        self.vocab_size = vocab_size
        self.eos_token_ids: list[int] = []

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        out, run = [], bytearray()
        for t in ids:
            if t < 256:
                run.append(t)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(f"<|{t}|>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def chat(self, messages: list[dict]) -> list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        return self.encode(text)


class HFTokenizer:
    kind = "checkpoint"

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = len(tok)
        eos = tok.eos_token_id
        self.eos_token_ids = [] if eos is None else [eos]

    def encode(self, text: str, special: bool = True) -> list[int]:
        """``special``: with the checkpoint's special tokens (a BOS, for some) around the text."""
        return list(self.tok.encode(text, add_special_tokens=special))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def chat(self, messages: list[dict]) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            ids = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        return self.encode(text)


def load_tokenizer(name_or_path: str, vocab_size: int):
    """The checkpoint's tokenizer when ``name_or_path`` is a real model's name or a directory holding one, else the byte-level fallback."""
    from kvflow.model import catalog

    path = catalog.resolve(name_or_path) if catalog.is_real(name_or_path) else Path(name_or_path).expanduser()
    if path.is_dir() and any((path / f).is_file() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer
        try:
            return HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
        except (OSError, ValueError) as err:
            raise ModelError(f"{name_or_path}: cannot load its tokenizer: {str(err).splitlines()[0]}") from None
    return ByteTokenizer(vocab_size)
