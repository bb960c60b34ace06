"""The checkpoint's chat template: OpenAI-style messages → the prompt text the model was tuned on.

Read as transformers saves it (`chat_template.jinja` beside the tokenizer, else the
`chat_template` key of tokenizer_config.json, a string or a list of named templates of which
"default" is used) and rendered as transformers renders it: a sandboxed Jinja environment with
`raise_exception`, `strftime_now` and the `tojson` filter, the tokenizer's `bos_token` and
`eos_token` in scope. Only the template is read, so the orchestrator needs no transformers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str) -> None:
    raise ValueError(f"The chat template refused the messages: {message}")


def _token_text(value: Any) -> str:
    """A special token from tokenizer_config.json: a string or an AddedToken's dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _template_text(model_dir: Path, config: dict[str, Any]) -> str | None:
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                                   indent=indent)  # fmt: skip
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"The checkpoint's chat template does not parse: {e}.") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The directory's chat template; None if its tokenizer has none."""
        path = Path(model_dir)
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = _template_text(path, config)
        if source is None:
            return None
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        return cls(source, bos, eos)

    def render(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of `messages`; ValueError when the template refuses them."""
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"The chat template failed on these messages: {e}.") from None
        except (TypeError, AttributeError, KeyError, ValueError, IndexError, RecursionError) as e:
            # a field of a type the template does not expect (`tool_calls: 5` iterated): the
            # client's fault, however the template's own code trips over it
            raise ValueError(
                f"The chat template failed on these messages ({type(e).__name__}: {e}); check "
                f"the type of each message field."
            ) from None
