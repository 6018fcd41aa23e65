"""Tokenizer loading (HF `tokenizers`, no transformers) and incremental decoding for streaming."""

from __future__ import annotations

from pathlib import Path

from dspark_trt.errors import DsparkError


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HfTokenizer

        if not Path(path).is_file():
            raise DsparkError(f"tokenizer file {path} is missing: re-export the artifact")
        try:
            self._tok = HfTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own exception type for a corrupt file
            raise DsparkError(f"{path} is not a valid tokenizer file ({str(e).splitlines()[0][:200]}): "
                              f"re-export the artifact") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_released(self, text: str) -> list[int]:
        """The ids encode() gives, but the tokenizer runs without holding the GIL (its batch API releases it,
        plain encode does not): a long text tokenizing in a worker thread does not stall the process's other
        threads, such as a server's event loop."""
        batch = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        return batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_to_id(self, token: str):
        return self._tok.token_to_id(token)


def load_tokenizer(path) -> Tokenizer:
    return Tokenizer(Path(path))


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already yielded

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece = text[self.emitted:]
        self.emitted = len(text)
        return piece

    def flush(self) -> str:
        text = self.tok.decode(self.ids)
        piece = text[self.emitted:]
        self.emitted = len(text)
        return piece
