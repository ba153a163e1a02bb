"""Text <-> token ids through Hugging Face `tokenizers` (tokenizer.json), plus the model's EOS ids."""

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from kiln.errors import KilnError


def _ids(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise KilnError(
                f"{model_dir} has no tokenizer.json: kiln reads fast (tokenizers) tokenizers only; "
                "save one with transformers' AutoTokenizer.save_pretrained, or pass token ids"
            )
        self._tok = HFTokenizer.from_file(str(path))
        self.eos_token_ids = self._eos_ids(model_dir)

    def _eos_ids(self, model_dir: Path) -> list[int]:
        """generation_config.json wins over config.json; tokenizer_config.json's eos_token is last."""
        for name in ("generation_config.json", "config.json"):
            f = model_dir / name
            if f.is_file():
                ids = _ids(json.loads(f.read_text()).get("eos_token_id"))
                if ids:
                    return ids
        f = model_dir / "tokenizer_config.json"
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if eos is not None and self._tok.token_to_id(eos) is not None:
                return [self._tok.token_to_id(eos)]
        return []

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)
