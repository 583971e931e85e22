#!/usr/bin/env python3
"""Golden references for chat rendering: what transformers' apply_chat_template makes of our
test conversations, under real-world chat templates.

Run from the repository root (no torch needed):

    pip install transformers jinja2 tokenizers
    python3 scripts/reference_chat.py

Writes tests/fixtures/chat/:

    conversations.jsonl          the conversations ({"messages": [...]}), shared by all cases
    <case>/tokenizer.json        recipes/assets/tiny-llama/tokenizer.json plus the template's
                                 control tokens as added tokens (ids 512 and up)
    <case>/tokenizer_config.json bos / eos / pad tokens and the chat_template
    <case>/expected.jsonl        per conversation: the rendered text, the token ids, the
                                 generation prompt, and what each assistant turn must train on
                                 (or the error the template raises)

and the reference for the tiny model we ship (its own tokenizer and template) in
tests/fixtures/chat/tiny-llama/expected.jsonl.

Cases: "llama3" (Llama-3-Instruct's template), "llama31" (Llama-3.1-style: system message
slotted into a dated system header, `messages[1:]`), "qwen25" (Qwen2.5-Instruct-style ChatML with
tools and tool calls, `tojson`), "llama2" (Llama-2-chat's [INST] template: `.strip()`,
`raise_exception`), "chatml-generation" (ChatML whose assistant text is marked with
{% generation %} blocks, so transformers' own return_assistant_tokens_mask is the reference for
our label mask). Rerunning gives byte-identical files.
"""

import json
import shutil
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "recipes" / "assets" / "tiny-llama"
OUT = ROOT / "tests" / "fixtures" / "chat"

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

CHATML_GENERATION = """{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {{- message.content + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

IM = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
L3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# name: (template, special tokens added, plain added tokens, tokenizer_config special tokens,
#        the text each assistant message must train on)
CASES = {
    "llama3": (LLAMA3, L3, [], {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
               lambda m: m["content"].strip() + "<|eot_id|>"),
    "llama31": (LLAMA31, L3, [], {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                lambda m: (m["content"].strip() if "tool_calls" not in m else
                           '{"name": "%s", "parameters": %s}' % (
                               m["tool_calls"][0]["function"]["name"],
                               json.dumps(m["tool_calls"][0]["function"]["arguments"], ensure_ascii=False)))
                + "<|eot_id|>"),
    "qwen25": (QWEN25, IM, ["<tool_call>", "</tool_call>"],
               {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
               lambda m: (m.get("content") or "") + "".join(
                   ('\n' if i or m.get("content") else "") + '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>'
                   % (t["function"]["name"], json.dumps(t["function"]["arguments"], ensure_ascii=False))
                   for i, t in enumerate(m.get("tool_calls") or [])) + "<|im_end|>"),
    "llama2": (LLAMA2, [], [], {"bos_token": "<s>", "eos_token": "</s>"},
               lambda m: " " + m["content"].strip() + " </s>"),
    "chatml-generation": (CHATML_GENERATION, IM, [], {"eos_token": "<|im_end|>"},
                          lambda m: m["content"] + "<|im_end|>"),
}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TOOL_CALL = {"role": "assistant", "tool_calls": [{"type": "function", "function": {
    "name": "get_weather", "arguments": {"city": "Paris", "days": 2, "units": "c", "note": "é \"x\" <y>"}}}]}
CONVERSATIONS = [
    [{"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Two plus two is four."}],
    [SYSTEM,
     {"role": "user", "content": "Spell the word \"cat\"."},
     {"role": "assistant", "content": "C-A-T."},
     {"role": "user", "content": "And \"dog\"?"},
     {"role": "assistant", "content": "D-O-G."}],
    # Whitespace around the content: Llama-3 trims it, ChatML keeps it.
    [{"role": "user", "content": "  Say hi.  "},
     {"role": "assistant", "content": "  Hi there!\n"}],
    # The answer also appears in the question: the turn must be found after the question.
    [{"role": "user", "content": "Reply with yes: yes"},
     {"role": "assistant", "content": "yes"}],
    [{"role": "user", "content": "Write café, naïve and ☕."},
     {"role": "assistant", "content": "Café — naïve ☕ “quoted”."}],
    # Ends with a user turn: nothing after it to train on.
    [{"role": "user", "content": "First?"},
     {"role": "assistant", "content": "One."},
     {"role": "user", "content": "Second?"}],
    # A null key (dropped, as transformers 5 does).
    [{"role": "user", "content": "Null tool calls?"},
     {"role": "assistant", "content": "None here.", "tool_calls": None}],
    # A tool call and its result (templates without tools raise or render what they can).
    [{"role": "user", "content": "Weather in Paris?"},
     TOOL_CALL,
     {"role": "tool", "content": "{\"temp\": 21}"},
     {"role": "assistant", "content": "It is 21 degrees."}],
    # Two user turns in a row: Llama-2's template raises.
    [{"role": "user", "content": "Hello."},
     {"role": "user", "content": "Hello again."},
     {"role": "assistant", "content": "Hi."}],
]


def jsonl(rows):
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def make_tokenizer(dir_, special, plain):
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    if special:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if plain:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    (dir_ / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")


def reference(tok, messages, turn_target):
    """What transformers makes of one conversation."""
    try:
        text = tok.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # the template's raise_exception
        return {"error": str(e)}
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True)
    row = {"text": text, "input_ids": list(out["input_ids"])}
    if messages[-1]["role"] == "assistant":
        row["generation_prompt"] = tok.apply_chat_template(
            messages[:-1], tokenize=False, add_generation_prompt=True)
    if "{% generation %}" in (tok.chat_template or "") or "{%- generation %}" in (tok.chat_template or ""):
        masked = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        row["assistant_masks"] = list(masked["assistant_masks"])
    if turn_target is not None:
        try:
            row["turn_targets"] = [turn_target({k: v for k, v in m.items() if v is not None})
                                   for m in messages if m["role"] == "assistant"]
        except KeyError:
            pass  # a message this case's rule does not describe (a tool call without content)
    return row


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "conversations.jsonl").write_text(
        jsonl({"messages": c} for c in CONVERSATIONS), encoding="utf-8")
    for name, (template, special, plain, tokens, turn_target) in CASES.items():
        d = OUT / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        make_tokenizer(d, special, plain)
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
               "add_eos_token": False, **tokens, "chat_template": template}
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n",
                                                 encoding="utf-8")
        tok = AutoTokenizer.from_pretrained(str(d))
        rows = [reference(tok, c, turn_target) for c in CONVERSATIONS]
        (d / "expected.jsonl").write_text(jsonl(rows), encoding="utf-8")
        errors = sum("error" in r for r in rows)
        print(f"{name}: {len(rows)} conversations ({errors} raise), vocab {tok.vocab_size}+{len(tok) - tok.vocab_size}")

    # The tiny model we ship: its own tokenizer files and template (ChatML markers as plain text,
    # every turn ended by </s>).
    tok = AutoTokenizer.from_pretrained(str(TINY))
    d = OUT / "tiny-llama"
    d.mkdir(parents=True, exist_ok=True)
    rows = [reference(tok, c, lambda m: m["content"] + "</s>") for c in CONVERSATIONS[:7]]
    (d / "expected.jsonl").write_text(jsonl(rows), encoding="utf-8")
    print(f"tiny-llama: {len(rows)} conversations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
