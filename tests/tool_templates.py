"""Chat templates with tools, written for the tests in the shapes checkpoints ship (no
hub download here): Qwen2.5's Hermes-style `<tool_call>` blocks, Llama 3.1's JSON tool
calling with the `ipython` role, and Mistral's `[AVAILABLE_TOOLS]` / `[TOOL_CALLS]`.
Each uses what those templates use: `tools` as transformers passes it, `tool_calls` with
arguments as objects, `tojson`, tool results as role `tool`."""

HERMES = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}You are a helpful assistant.{%- endif %}
{{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

LLAMA3 = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none and messages | length > 0 %}
    {%- set first_user_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {{- message.content }}{{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

MISTRAL = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- if tools is not none and loop.last %}
            {{- "[AVAILABLE_TOOLS][" }}
            {%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ", " }}{%- endif %}{%- endfor %}
            {{- "][/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST]" + message['content'] + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS][" }}
        {%- for tool_call in message.tool_calls %}
            {{- '{"name": "' + tool_call.function.name + '", "arguments": ' + tool_call.function.arguments | tojson + "}" }}
            {%- if not loop.last %}{{- ", " }}{%- endif %}
        {%- endfor %}
        {{- "]" + eos_token }}
    {%- elif message['role'] == 'assistant' %}
        {{- message['content'] + eos_token }}
    {%- elif message['role'] == 'tool' %}
        {{- '[TOOL_RESULTS]{"content": ' + message.content|string + "}[/TOOL_RESULTS]" }}
    {%- elif message['role'] == 'system' %}
        {{- "[INST]" + message['content'] + "[/INST]" }}
    {%- endif %}
{%- endfor %}
"""

TEMPLATES = {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL}


def model_with_template(folder, source: str):
    """The built-in model in `folder` (its files linked) with `source` as its chat
    template, config.json's record of the template file updated to match."""
    import hashlib
    import json
    import os
    from pathlib import Path

    from colibri_core.config import builtin_model_dir
    src, d = builtin_model_dir(), Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("chat_template.jinja", "config.json"):
            os.symlink(f, d / f.name)
    data = source.encode()
    cfg = json.loads((src / "config.json").read_text())
    cfg["files"]["chat_template.jinja"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                           "size": len(data)}
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    (d / "chat_template.jinja").write_bytes(data)
    return d
