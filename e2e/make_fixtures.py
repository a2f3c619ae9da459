"""Golden vectors made with vLLM's own code (the venv `make e2e-vllm` installs), for the
router's tests: how vLLM turns an Anthropic `/v1/messages` request into the chat messages and
tools its chat template renders (AnthropicServingMessages.to_chat_completion_request), how it
turns an OpenAI `/v1/responses` request into the same (OnlineRenderer.render_responses's steps:
construct_tool_dicts, construct_input_messages, ResponsesRequest.build_chat_params, then
parse_chat_messages for the conversation the template reads), and the
block hashes of LoRA adapter requests (a v1 Request with a LoRARequest, hashed by the engine's
own get_request_block_hasher with sha256_cbor, PYTHONHASHSEED=1729).

Usage: .venv-vllm/bin/python e2e/make_fixtures.py fixtures/   (make fixtures-vllm)
"""

import copy
import json
import os
import sys
from pathlib import Path

# The engine reads the NONE_HASH seed from the environment when init_none_hash runs.
os.environ["PYTHONHASHSEED"] = "1729"

import vllm
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages


def anthropic_cases():
    tool = {
        "name": "read_file",
        "description": "Read a file",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
            "required": ["path"],
        },
    }
    return {
        "plain": {
            "model": "m",
            "max_tokens": 16,
            "system": "You are terse.",
            "messages": [{"role": "user", "content": "Hello there"}],
        },
        "no_system": {
            "model": "m",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "Hi"}],
        },
        "system_blocks_and_billing_header": {
            "model": "m",
            "max_tokens": 16,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2.3; hash=abc"},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": " Be careful."},
            ],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "go"}]}],
        },
        "multi_turn_blocks": {
            "model": "m",
            "max_tokens": 16,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Let me think.", "signature": "sig"},
                    {"type": "text", "text": "Answer."},
                ]},
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "b64"}, {"type": "text", "text": "More."}]},
                {"role": "user", "content": "thanks"},
            ],
        },
        "tools_round_trip": {
            "model": "m",
            "max_tokens": 16,
            "system": "Use tools.",
            "tools": [tool, {"name": "noop", "input_schema": {"type": "object"}, "strict": True}],
            "tool_choice": {"type": "auto"},
            "messages": [
                {"role": "user", "content": "Read the README"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "toolu_1", "name": "read_file",
                     "input": {"path": "README.md", "lines": 10, "opts": {"z": [1, 2.5, 1e-07, 1e20, -0.0, True, None], "a": "caf\u00e9 \U0001F600 \"q\" \\ \n"}}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "line one\nline two"},
                    {"type": "text", "text": "and now?"},
                ]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "noop", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": [
                        {"type": "text", "text": "part a"}, {"type": "text", "text": "part b"}]},
                ]},
            ],
        },
        "tool_result_only": {
            "model": "m",
            "max_tokens": 16,
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"k": "v"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
            ],
        },
        "inline_system": {
            "model": "m",
            "max_tokens": 16,
            "system": "Top.",
            "messages": [
                {"role": "user", "content": "one"},
                {"role": "system", "content": "Reminder."},
                {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: h"}]},
                {"role": "user", "content": "two"},
            ],
        },
        "image": {
            "model": "m",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                {"type": "image", "source": {"type": "url", "url": "https://example.invalid/a.png"}},
                {"type": "text", "text": "what is this?"},
            ]}],
        },
        "salt_stream_kwargs": {
            "model": "m",
            "max_tokens": 16,
            "stream": True,
            "cache_salt": "tenant-a",
            "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "user", "content": "Hi"}],
        },
    }


def responses_cases():
    weather = {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
        "strict": True,
    }
    return {
        "string_input": {"model": "m", "input": "Hello there"},
        "instructions": {
            "model": "m",
            "instructions": "You are terse.",
            "max_output_tokens": 16,
            "input": "Hi",
        },
        "empty_instructions": {"model": "m", "instructions": "", "input": "Hi"},
        "multi_turn_items": {
            "model": "m",
            "instructions": "Be kind.",
            "input": [
                {"role": "user", "content": "first question"},
                {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                 "content": [{"type": "output_text", "text": "first answer", "annotations": []},
                             {"type": "output_text", "text": "dropped: vLLM reads the first part", "annotations": []}]},
                {"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "part one"}, {"type": "input_text", "text": "part two"}]},
                {"role": "assistant", "content": "second answer"},
                {"role": "assistant", "content": [{"type": "input_text", "text": "more"}]},
                {"role": "developer", "content": "Answer in French."},
                {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Late system."}]},
                {"role": "user", "content": "caf\u00e9 \U0001F600 \"q\" \\ \n"},
            ],
        },
        "function_call_round_trip": {
            "model": "m",
            "instructions": "Use tools.",
            "tools": [
                weather,
                {"type": "function", "name": "noop", "parameters": None, "strict": False},
                {"type": "web_search_preview"},
            ],
            "tool_choice": "auto",
            "input": [
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                 "arguments": "{\"city\": \"Paris\"}", "status": "completed"},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather",
                 "arguments": "{\"city\":\"Rome\",\"days\":2}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny, then rain."}]},
                {"role": "user", "content": "Thanks"},
            ],
        },
        "reasoning_items": {
            "model": "m",
            "input": [
                {"role": "user", "content": "2+2?"},
                {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "Add them."}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
                {"role": "user", "content": "and 3+3?"},
                {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Summed."}]},
                {"type": "function_call", "call_id": "c", "name": "calc", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "6"},
                {"type": "reasoning", "id": "rs_3", "summary": []},
            ],
        },
        "cache_salt_stream": {
            "model": "m",
            "stream": True,
            "cache_salt": "tenant-a",
            "store": False,
            "input": [{"role": "user", "content": "Hi"}],
        },
        "chat_template_kwargs_and_reasoning": {
            "model": "m",
            "chat_template_kwargs": {"enable_thinking": False, "custom": [1, "x"]},
            "reasoning": {"effort": "high"},
            "input": "Think hard.",
        },
        "reasoning_effort": {"model": "m", "reasoning": {"effort": "low", "summary": "auto"}, "input": "x"},
        "reasoning_effort_none": {"model": "m", "reasoning": {"effort": "none"}, "input": "x"},
        "partial_final_message": {
            "model": "m",
            "input": [
                {"role": "user", "content": "Write a haiku"},
                {"type": "message", "role": "assistant", "status": "incomplete",
                 "content": [{"type": "output_text", "text": "Autumn moonlight"}]},
            ],
        },
        "namespace_and_custom_tools": {
            "model": "m",
            "tools": [
                {"type": "namespace", "name": "fs", "description": "Files", "tools": [
                    {"type": "function", "name": "read", "description": "Read a file",
                     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
                ]},
                {"type": "custom", "name": "apply_patch", "description": "Apply a patch"},
            ],
            "input": [
                {"role": "user", "content": "patch it"},
                {"type": "function_call", "call_id": "c1", "namespace": "fs", "name": "read",
                 "arguments": "{\"path\": \"a\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "text"},
                {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** patch \u00e9"},
                {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
            ],
        },
    }


def responses_fixture_cases():
    import types

    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import (
        construct_input_messages,
        construct_tool_dicts,
    )
    from vllm.renderers.chat_utils import parse_chat_messages

    # Text-only conversations: the multimodal tracker reads no more of the model's config.
    model_config = types.SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False)
    cases = []
    for name, request in responses_cases().items():
        parsed = ResponsesRequest.model_validate(copy.deepcopy(request))
        tools = construct_tool_dicts(parsed.tools, parsed.tool_choice)
        messages = construct_input_messages(
            request_instructions=parsed.instructions, request_input=parsed.input
        )
        params = parsed.build_chat_params(None, "auto")
        kwargs = dict(params.chat_template_kwargs)
        add_generation_prompt = kwargs.pop("add_generation_prompt")
        continue_final_message = kwargs.pop("continue_final_message")
        conversations = {}
        for content_format in ("string", "openai"):
            conversation, _, _ = parse_chat_messages(
                copy.deepcopy(messages), model_config, content_format
            )
            conversations[content_format] = conversation
        cases.append({
            "name": name,
            "request": request,
            "body": json.dumps(request, ensure_ascii=False),
            "messages": messages,
            "conversation_string": conversations["string"],
            "conversation_openai": conversations["openai"],
            "tools": None if tools is None else [strip_none(t) for t in tools],
            "chat_template_kwargs": kwargs or None,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "cache_salt": parsed.cache_salt,
            "stream": bool(parsed.stream),
        })
    return cases


def lora_block_hash_cases():
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    kv_cache_utils.init_none_hash(sha256_cbor)
    tokens = [(i * 7919 + 13) % 150000 for i in range(80)] + [0, 1, 23, 24, 255, 256, 65535, 65536]
    adapters = [
        ("sql", "/adapters/sql"),
        ("sql", "/other/place/sql"),  # same name, another path: other hashes
        ("café-ünï", "/adapters/a-path-longer-than-twenty-three-bytes/ünï"),
        ("x", "p"),
    ]
    cases = []
    for block_size in (16, 32):
        for name, path in adapters:
            for salt in (None, "tenant-a"):
                lora = LoRARequest(lora_name=name, lora_int_id=1, lora_path=path)
                request = Request(
                    request_id="golden",
                    prompt_token_ids=tokens,
                    sampling_params=SamplingParams(max_tokens=1),
                    pooling_params=None,
                    lora_request=lora,
                    cache_salt=salt,
                    block_hasher=kv_cache_utils.get_request_block_hasher(block_size, sha256_cbor),
                )
                digests = [bytes(h) for h in request.block_hashes]
                cases.append({
                    "algo": "sha256_cbor",
                    "seed": "1729",
                    "block_size": block_size,
                    "lora_name": name,
                    "lora_path": path,
                    "cache_salt": salt,
                    "tokens": tokens,
                    "digests": [d.hex() for d in digests],
                    "external_u64": [int.from_bytes(d[-8:], "big") for d in digests],
                })
    return cases


def strip_none(value):
    if isinstance(value, dict):
        return {k: strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_none(v) for v in value]
    return value


def main(out_dir: Path):
    cases = []
    for name, request in anthropic_cases().items():
        for merge in (False, True):
            parsed = AnthropicMessagesRequest.model_validate(request)
            chat = AnthropicServingMessages.to_chat_completion_request(parsed, merge_inline_system=merge)
            cases.append({
                "name": name,
                "merge_inline_system": merge,
                "request": request,
                # The body as sent, keys in order (a tool input's order reaches the prompt).
                "body": json.dumps(request, ensure_ascii=False),
                "messages": chat.messages,
                "tools": None if chat.tools is None else [strip_none(t.model_dump()) for t in chat.tools],
                "cache_salt": chat.cache_salt,
                "stream": bool(chat.stream),
                "chat_template_kwargs": chat.chat_template_kwargs,
            })
    out = {
        "made_by": f"vllm {vllm.__version__}: AnthropicServingMessages.to_chat_completion_request (e2e/make_fixtures.py)",
        "cases": cases,
    }
    path = out_dir / f"vllm-{vllm.__version__}-anthropic-messages.json"
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}: {len(cases)} cases")

    responses = {
        "made_by": f"vllm {vllm.__version__}: ResponsesRequest, construct_tool_dicts, "
                   "construct_input_messages, build_chat_params, parse_chat_messages "
                   "(e2e/make_fixtures.py)",
        "cases": responses_fixture_cases(),
    }
    path = out_dir / f"vllm-{vllm.__version__}-responses.json"
    path.write_text(json.dumps(responses, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}: {len(responses['cases'])} cases")

    lora = {
        "made_by": f"vllm {vllm.__version__}: Request(lora_request=LoRARequest(...)).block_hashes "
                   "with get_request_block_hasher(block_size, sha256_cbor), PYTHONHASHSEED=1729 "
                   "(e2e/make_fixtures.py)",
        "cases": lora_block_hash_cases(),
    }
    path = out_dir / f"vllm-{vllm.__version__}-lora-block-hashes.json"
    path.write_text(json.dumps(lora, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}: {len(lora['cases'])} cases")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
