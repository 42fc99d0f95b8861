"""Find a checkpoint's chat template and render messages with it.

Where the template comes from, in order: `chat_template.jinja`,
`chat_template.json` (`{"chat_template": ...}`), the `chat_template` key of
`tokenizer_config.json`, and finally the built-in Qwen3-VL template. Rendering
uses transformers' `apply_chat_template`, the same Jinja environment the
checkpoint's authors wrote the template for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The Qwen3-VL chat format for system/user/assistant turns with images.
BUILTIN_QWEN3_VL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def load_chat_template(checkpoint_dir: str | Path) -> str:
    checkpoint_dir = Path(checkpoint_dir)
    jinja_file = checkpoint_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    for json_name, key in (("chat_template.json", "chat_template"), ("tokenizer_config.json", "chat_template")):
        path = checkpoint_dir / json_name
        if path.is_file():
            template = json.loads(path.read_text(encoding="utf-8")).get(key)
            if isinstance(template, str) and template:
                return template
    return BUILTIN_QWEN3_VL_TEMPLATE


def render_chat(tokenizer: Any, template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )
