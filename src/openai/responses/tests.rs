use serde_json::{Value, json};

use super::*;
use crate::openai::converted::test_support::{assert_settings_match, chat_of};

/// Vectors made with vLLM's own conversion (`make fixtures-vllm`).
const FIXTURES: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/fixtures/vllm-0.32.0-responses.json"
));

fn messages_of(request: &ParsedRequest) -> Vec<Value> {
    serde_json::from_str(chat_of(request).messages.get()).expect("messages JSON")
}

/// A message as vLLM's chat parser reads it: only the keys it keeps (not an input item's
/// `type` or `status`), text parts of any kind (`input_text`, `output_text`, `text`) alike.
fn as_parsed(message: &Value) -> Value {
    let mut out = serde_json::Map::new();
    for (key, value) in message.as_object().expect("a message object") {
        match key.as_str() {
            "type" | "status" | "id" => {}
            "content" => {
                let value = match value {
                    Value::Array(parts) => Value::Array(
                        parts
                            .iter()
                            .map(|p| json!({"type": "text", "text": p["text"]}))
                            .collect(),
                    ),
                    other => other.clone(),
                };
                out.insert(key.clone(), value);
            }
            _ => {
                out.insert(key.clone(), value.clone());
            }
        }
    }
    Value::Object(out)
}

/// A message's content as vLLM's "string" content format renders it: parts' texts joined by
/// newlines, no content as "".
fn string_content(message: &Value) -> Value {
    match &message["content"] {
        Value::Array(parts) => Value::from(
            parts
                .iter()
                .map(|p| p["text"].as_str().unwrap_or_default())
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        Value::Null => Value::from(""),
        other => other.clone(),
    }
}

#[test]
fn the_conversation_is_the_one_vllm_renders() {
    let fixtures: Value = serde_json::from_str(FIXTURES).expect("fixtures");
    let mut checked = 0;
    for case in fixtures["cases"].as_array().expect("cases") {
        let name = case["name"].as_str().expect("name");
        let body = case["body"].as_str().expect("the body as sent");
        let request = parse_responses(body).unwrap_or_else(|e| panic!("{name}: {e}"));
        let chat = chat_of(&request);
        let messages = messages_of(&request);
        let expected = case["messages"].as_array().expect("messages");
        assert_eq!(
            messages.iter().map(as_parsed).collect::<Vec<_>>(),
            expected.iter().map(as_parsed).collect::<Vec<_>>(),
            "{name}: messages"
        );
        // What the template reads (vLLM's parse_chat_messages, "string" format): the same
        // roles and texts, message for message.
        let conversation = case["conversation_string"]
            .as_array()
            .expect("conversation");
        assert_eq!(messages.len(), conversation.len(), "{name}: message count");
        for (mine, theirs) in messages.iter().zip(conversation) {
            assert_eq!(mine["role"], theirs["role"], "{name}: role");
            assert_eq!(string_content(mine), theirs["content"], "{name}: content");
            assert_eq!(
                mine.get("reasoning"),
                theirs.get("reasoning"),
                "{name}: reasoning"
            );
        }
        assert_settings_match(name, &request, case);
        assert_eq!(
            chat.add_generation_prompt,
            case["add_generation_prompt"].as_bool(),
            "{name}: add_generation_prompt"
        );
        assert_eq!(
            chat.continue_final_message,
            case["continue_final_message"].as_bool(),
            "{name}: continue_final_message"
        );
        assert_eq!(chat.unreproducible, None, "{name}");
        assert_eq!(request.model, "m");
        assert_eq!(request.kind, EndpointKind::Responses);
        checked += 1;
    }
    assert_eq!(checked, 12, "every vector checked");
}

#[test]
fn input_parts_are_written_as_chat_parts() {
    let body = json!({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "look"},
        {"type": "input_image", "image_url": "https://example.invalid/a.png", "detail": "auto"},
    ]}]});
    let request = parse_responses(&body.to_string()).expect("parses");
    assert_eq!(chat_of(&request).unreproducible, None);
    assert_eq!(
        messages_of(&request),
        vec![json!({"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}},
        ]})]
    );
}

#[test]
fn what_vllm_renders_from_its_own_state_is_marked() {
    for (why, body) in [
        (
            "previous_response_id",
            json!({"model": "m", "previous_response_id": "resp_1", "input": "more"}),
        ),
        (
            "an item reference",
            json!({"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]}),
        ),
        (
            "a file input",
            json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
        ),
        (
            "an image by file id",
            json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}),
        ),
        (
            "encrypted reasoning",
            json!({"model": "m", "input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}),
        ),
        (
            "an unsupported input item",
            json!({"model": "m", "input": [{"type": "web_search_call", "id": "w", "status": "completed"}]}),
        ),
        (
            "a partial input message",
            json!({"model": "m", "input": [{"type": "message", "role": "user", "status": "incomplete", "content": "x"}]}),
        ),
        (
            "an assistant message without text first",
            json!({"model": "m", "input": [{"role": "assistant", "content": []}]}),
        ),
    ] {
        let request = parse_responses(&body.to_string()).expect(why);
        assert_eq!(chat_of(&request).unreproducible, Some(why), "{body}");
    }
}

#[test]
fn malformed_bodies_are_refused_with_the_reason() {
    for (body, why) in [
        ("{", "not valid JSON"),
        ("[]", "not valid JSON"),
        (r#"{"input": "x"}"#, "no \"model\""),
        (r#"{"model": "", "input": "x"}"#, "no \"model\""),
        (r#"{"model": 5, "input": "x"}"#, "invalid"),
        (r#"{"model": "m"}"#, "no \"input\""),
        (r#"{"model": "m", "input": null}"#, "no \"input\""),
        (r#"{"model": "m", "input": 3}"#, "\"input\" must be"),
        (r#"{"model": "m", "input": {}}"#, "\"input\" must be"),
        (r#"{"model": "m", "input": ["x"]}"#, "input item"),
        (
            r#"{"model": "m", "input": [{"content": "x"}]}"#,
            "input item",
        ),
        (
            r#"{"model": "m", "input": [{"role": "tool", "content": "x"}]}"#,
            "\"role\"",
        ),
        (
            r#"{"model": "m", "input": [{"role": "user", "content": 7}]}"#,
            "\"content\"",
        ),
        (
            r#"{"model": "m", "input": [{"role": "user"}]}"#,
            "\"content\"",
        ),
        (
            r#"{"model": "m", "input": [{"type": "function_call", "name": "f"}]}"#,
            "input item",
        ),
        (
            r#"{"model": "m", "input": "x", "instructions": 1}"#,
            "invalid",
        ),
        (r#"{"model": "m", "input": "x", "tools": {}}"#, "invalid"),
        (
            r#"{"model": "m", "input": "x", "tools": [{"type": "function"}]}"#,
            "\"name\"",
        ),
        (
            r#"{"model": "m", "input": "x", "chat_template_kwargs": [1]}"#,
            "chat_template_kwargs",
        ),
        (
            r#"{"model": "m", "input": "x", "stream": "yes"}"#,
            "invalid",
        ),
    ] {
        let error = parse_responses(body).expect_err(body).to_string();
        assert!(error.contains(why), "{body}: {error}");
    }
}

#[test]
fn responses_is_an_openai_style_endpoint() {
    assert_eq!(
        EndpointKind::from_path("/v1/responses?x=1"),
        Some(EndpointKind::Responses)
    );
    assert_eq!(
        EndpointKind::Responses.error_style(),
        super::super::ErrorStyle::OpenAi
    );
    let parsed = super::super::parse_request(
        EndpointKind::Responses,
        br#"{"model":"m","input":"hi","stream":true}"#,
    )
    .expect("parses");
    assert_eq!(parsed.kind, EndpointKind::Responses);
    assert!(parsed.stream);
    assert_eq!(EndpointKind::Responses.as_str(), "responses");
}
