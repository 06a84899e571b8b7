"""The models the HTTP API offers: one per model name the live schedulers serve, and one per LoRA adapter they
have loaded (its base model's tokenizer), each with its tokenizer for logprobs."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import decoders

from router.discovery import SchedulerDirectory
from router.tokenizer import ChatTemplating, RouterTokenizer, load_tokenizer


@dataclass(frozen=True)
class ServedModel:
    name: str                  # what clients put in "model"
    route_name: str            # what the router matches schedulers on ("" when a scheduler did not say)
    tokenizer: RouterTokenizer
    max_model_len: int = 0
    parent: str = ""           # a LoRA adapter's base model ("": a base model)
    alias_of: str = ""         # another name of the model named so (--served-model-name): responses give that one
    model_path: str = ""       # its folder as the schedulers name it (config.json): "" when not known

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's raw bytes: exact for byte-level BPE, where a piece may be half a UTF-8 character."""
        tokenizer = self.tokenizer.tokenizer
        piece = tokenizer.id_to_token(token_id) or ""
        if isinstance(tokenizer.decoder, decoders.ByteLevel) and all(c in UNICODE_TO_BYTE for c in piece):
            return [UNICODE_TO_BYTE[c] for c in piece]
        return list(self.token_text(token_id).encode())


ModelsFn = Callable[[], list[ServedModel]]


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    mapping = {chr(b): b for b in printable}
    mapping.update({chr(256 + i): b for i, b in enumerate(extra)})
    return mapping


UNICODE_TO_BYTE = byte_level_alphabet()


def directory_models(directory: SchedulerDirectory, templating: ChatTemplating = ChatTemplating()) -> ModelsFn:
    """The models the live schedulers serve, one entry per name, their chats rendered as `templating` says."""
    def served() -> list[ServedModel]:
        models: dict[str, ServedModel] = {}
        for info in directory.schedulers():
            name = info.model or Path(info.model_path).name
            if name not in models and info.model_path:
                models[name] = ServedModel(name, info.model, load_tokenizer(info.model_path, templating),
                                           info.max_model_len, model_path=info.model_path)
                for alias in info.model_aliases:
                    models.setdefault(alias, ServedModel(alias, info.model, models[name].tokenizer,
                                                         info.max_model_len, alias_of=name,
                                                         model_path=info.model_path))
            for adapter in info.lora_adapters:
                if adapter not in models and name in models:
                    models[adapter] = ServedModel(adapter, adapter, models[name].tokenizer, info.max_model_len, name,
                                                  model_path=info.model_path)
        return list(models.values())
    return served
