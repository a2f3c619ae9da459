use serde_json::{Value, json};

use super::*;
use crate::openai::converted::test_support::{assert_settings_match, chat_of};

/// Vectors made with vLLM's own conversion (`make fixtures-vllm`).
const FIXTURES: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/fixtures/vllm-0.32.0-anthropic-messages.json"
));

#[test]
fn the_conversation_is_the_one_vllm_renders() {
    let fixtures: Value = serde_json::from_str(FIXTURES).expect("fixtures");
    let mut checked = 0;
    for case in fixtures["cases"].as_array().expect("cases") {
        // vLLM merges inline system messages only for templates that refuse them; the router
        // keeps them in place (see the module docs).
        if case["merge_inline_system"] == true {
            continue;
        }
        let name = case["name"].as_str().expect("name");
        let body = case["body"].as_str().expect("the body as sent");
        let request = parse_messages(body).unwrap_or_else(|e| panic!("{name}: {e}"));
        let chat = chat_of(&request);
        let messages: Value = serde_json::from_str(chat.messages.get()).expect("messages JSON");
        assert_eq!(messages, case["messages"], "{name}: messages");
        assert_settings_match(name, &request, case);
        assert_eq!(chat.unreproducible, None, "{name}");
        assert_eq!(request.model, "m");
        assert_eq!(request.kind, EndpointKind::Messages);
        checked += 1;
    }
    assert_eq!(checked, 9, "every vector checked");
}

#[test]
fn a_tool_calls_arguments_are_pythons_json_dumps_of_its_input() {
    let body = json!({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "a", "name": "f", "input": {"b":1.0,"a":[1e-5,"é"]}},
            {"type": "tool_use", "id": "b", "name": "g", "input": {}},
            {"type": "tool_use", "id": "c", "name": "h"},
        ]},
    ]})
    .to_string();
    let request = parse_messages(&body).expect("parses");
    let messages: Value = serde_json::from_str(chat_of(&request).messages.get()).expect("JSON");
    let calls = &messages[1]["tool_calls"];
    // serde_json writes the input's keys sorted; Python keeps them as sent, as does the router.
    assert_eq!(
        calls[0]["function"]["arguments"],
        r#"{"a": [1e-05, "\u00e9"], "b": 1.0}"#
    );
    assert_eq!(calls[1]["function"]["arguments"], "{}");
    assert_eq!(calls[2]["function"]["arguments"], "{}");
    assert!(messages[1].get("content").is_none());
}

#[test]
fn what_vllm_renders_unpredictably_is_marked() {
    for (why, body) in [
        (
            "thinking disabled",
            json!({"model": "m", "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "x"}]}),
        ),
        (
            "a tool_use without an id",
            json!({"model": "m", "messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {"a": 1}}]}]}),
        ),
        (
            "a tool result in an assistant turn",
            json!({"model": "m", "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "r"}]}]}]}),
        ),
        (
            "tool additions or removals",
            json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "tool_removal", "tool": {"name": "f"}}, {"type": "text", "text": "x"}]}]}),
        ),
    ] {
        let request = parse_messages(&body.to_string()).expect(why);
        assert_eq!(chat_of(&request).unreproducible, Some(why));
    }
    // A string tool result in an assistant turn is reproducible.
    let body = json!({"model": "m", "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]});
    let request = parse_messages(&body.to_string()).expect("parses");
    let chat = chat_of(&request);
    assert_eq!(chat.unreproducible, None);
    let messages: Value = serde_json::from_str(chat.messages.get()).expect("JSON");
    assert_eq!(messages[0]["content"], "Tool result: ok");
}

#[test]
fn an_effort_reaches_the_template_as_vllm_passes_it() {
    let body = json!({"model": "m", "output_config": {"effort": "high"},
        "chat_template_kwargs": {"x": 1}, "messages": [{"role": "user", "content": "x"}]});
    let request = parse_messages(&body.to_string()).expect("parses");
    let kwargs: Value = serde_json::from_str(
        chat_of(&request)
            .chat_template_kwargs
            .as_ref()
            .expect("kwargs")
            .get(),
    )
    .expect("JSON");
    assert_eq!(
        kwargs,
        json!({"x": 1, "reasoning_effort": "high", "enable_thinking": true})
    );
}

#[test]
fn malformed_bodies_are_refused_with_the_reason() {
    for (body, why) in [
        ("{", "not valid JSON"),
        ("[]", "not valid JSON"),
        (r#"{"messages": []}"#, "no \"model\""),
        (r#"{"model": "", "messages": []}"#, "no \"model\""),
        (r#"{"model": "m"}"#, "no \"messages\""),
        (r#"{"model": "m", "messages": {}}"#, "invalid"),
        (
            r#"{"model": "m", "messages": [{"role": "tool", "content": "x"}]}"#,
            "\"role\"",
        ),
        (
            r#"{"model": "m", "messages": [{"role": "user", "content": 7}]}"#,
            "\"content\"",
        ),
        (
            r#"{"model": "m", "messages": [{"role": "user"}]}"#,
            "invalid",
        ),
        (r#"{"model": "m", "system": 3, "messages": []}"#, "invalid"),
        (r#"{"model": 5, "messages": []}"#, "invalid"),
    ] {
        let error = parse_messages(body).expect_err(body).to_string();
        assert!(error.contains(why), "{body}: {error}");
    }
}
