use super::*;

fn completion(body: &str) -> Result<ParsedRequest, ParseError> {
    parse_request(EndpointKind::Completions, body.as_bytes())
}

fn chat(body: &str) -> Result<ParsedRequest, ParseError> {
    parse_request(EndpointKind::ChatCompletions, body.as_bytes())
}

#[test]
fn endpoint_kind_from_path_ignores_query_and_trailing_slash() {
    assert_eq!(
        EndpointKind::from_path("/v1/completions"),
        Some(EndpointKind::Completions)
    );
    assert_eq!(
        EndpointKind::from_path("/v1/chat/completions?x=1"),
        Some(EndpointKind::ChatCompletions)
    );
    assert_eq!(
        EndpointKind::from_path("/v1/chat/completions/"),
        Some(EndpointKind::ChatCompletions)
    );
    assert_eq!(EndpointKind::from_path("/v1/models"), None);
    assert_eq!(EndpointKind::from_path("/v1/completionsx"), None);
}

#[test]
fn text_prompt_with_model_salt_and_stream() {
    let req = completion(
        r#"{"model":"tiny","prompt":"hello \"world\"\n","cache_salt":"s1","stream":true,"max_tokens":5}"#,
    )
    .unwrap();
    assert_eq!(req.model, "tiny");
    assert_eq!(req.kind, EndpointKind::Completions);
    assert_eq!(req.cache_salt.as_deref(), Some("s1"));
    assert!(req.stream);
    match req.input {
        RequestInput::Completion(Prompt::Text(t)) => {
            assert_eq!(t.as_str(), "hello \"world\"\n");
            assert_eq!(t.raw_json().get(), r#""hello \"world\"\n""#);
        }
        other => panic!("unexpected input {other:?}"),
    }
}

#[test]
fn token_id_prompt_and_batches_route_by_first_element() {
    let ids = completion(r#"{"model":"m","prompt":[1, 2, 3]}"#).unwrap();
    assert!(
        matches!(ids.input, RequestInput::Completion(Prompt::TokenIds(ref v)) if v == &[1, 2, 3])
    );
    let text_batch = completion(r#"{"model":"m","prompt":["a","b"]}"#).unwrap();
    assert!(
        matches!(text_batch.input, RequestInput::Completion(Prompt::Text(ref t)) if t.as_str() == "a")
    );
    let id_batch = completion(r#"{"model":"m","prompt":[[7,8],[9]]}"#).unwrap();
    assert!(
        matches!(id_batch.input, RequestInput::Completion(Prompt::TokenIds(ref v)) if v == &[7, 8])
    );
    assert!(!ids.stream);
    assert_eq!(ids.cache_salt, None);
}

#[test]
fn bad_prompts_are_rejected() {
    for body in [
        r#"{"model":"m","prompt":5}"#,
        r#"{"model":"m","prompt":[-1]}"#,
        r#"{"model":"m","prompt":["a", 1]}"#,
        r#"{"model":"m","prompt":[["a"]]}"#,
        r#"{"model":"m","prompt":{"a":1}}"#,
    ] {
        let result = completion(body);
        assert!(
            matches!(result, Err(ParseError::InvalidPrompt)),
            "{body}: {result:?}"
        );
    }
}

#[test]
fn missing_fields_are_named() {
    assert!(matches!(
        completion(r#"{"prompt":"x"}"#),
        Err(ParseError::MissingModel)
    ));
    assert!(matches!(
        completion(r#"{"model":"","prompt":"x"}"#),
        Err(ParseError::MissingModel)
    ));
    assert!(matches!(
        completion(r#"{"model":"m"}"#),
        Err(ParseError::MissingPrompt)
    ));
    assert!(matches!(
        completion(r#"{"model":"m","prompt":null}"#),
        Err(ParseError::MissingPrompt)
    ));
    assert!(matches!(
        chat(r#"{"model":"m","prompt":"x"}"#),
        Err(ParseError::MissingMessages)
    ));
    assert!(matches!(
        chat(r#"{"model":"m","messages":"hi"}"#),
        Err(ParseError::InvalidMessages)
    ));
    assert!(matches!(
        completion("{not json"),
        Err(ParseError::InvalidJson(_))
    ));
    assert!(matches!(completion(""), Err(ParseError::InvalidJson(_))));
    assert!(matches!(
        completion("[1,2]"),
        Err(ParseError::InvalidJson(_))
    ));
}

#[test]
fn chat_keeps_raw_json_slices_verbatim() {
    let body = r#"{"model":"lora-a","messages":[{"role":"user","content":"hi \u00e9"}],
        "tools":[{"type":"function","function":{"name":"f"}}],
        "chat_template_kwargs":{"enable_thinking":false},
        "add_generation_prompt":false,"stream":true,"cache_salt":"abc"}"#;
    let req = chat(body).unwrap();
    assert_eq!(req.model, "lora-a");
    assert!(req.stream);
    assert_eq!(req.cache_salt.as_deref(), Some("abc"));
    let RequestInput::Chat(input) = req.input else {
        panic!("not chat")
    };
    assert_eq!(
        input.messages.get(),
        r#"[{"role":"user","content":"hi \u00e9"}]"#
    );
    assert_eq!(
        input.tools.as_deref().map(RawValue::get),
        Some(r#"[{"type":"function","function":{"name":"f"}}]"#)
    );
    assert_eq!(
        input.chat_template_kwargs.as_deref().map(RawValue::get),
        Some(r#"{"enable_thinking":false}"#)
    );
    assert_eq!(input.add_generation_prompt, Some(false));
    assert_eq!(input.continue_final_message, None);
}

#[test]
fn null_tools_count_as_absent() {
    let req =
        chat(r#"{"model":"m","messages":[],"tools":null,"chat_template_kwargs":null}"#).unwrap();
    let RequestInput::Chat(input) = req.input else {
        panic!("not chat")
    };
    assert!(input.tools.is_none());
    assert!(input.chat_template_kwargs.is_none());
}

#[test]
fn megabyte_prompt_parses() {
    let prompt = "lorem ipsum ".repeat(90_000);
    let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 1}).to_string();
    assert!(body.len() > 1_000_000);
    let req = completion(&body).unwrap();
    assert!(
        matches!(req.input, RequestInput::Completion(Prompt::Text(ref t)) if t.as_str() == prompt)
    );
}

#[test]
fn prompt_text_decodes_lazily_and_keeps_the_literal() {
    let req = completion(r#"{"model":"m","prompt":"caf\u00e9 \ud83d\ude00"}"#).unwrap();
    let RequestInput::Completion(Prompt::Text(text)) = req.input else {
        panic!("not text")
    };
    assert_eq!(text.raw_json().get(), r#""caf\u00e9 \ud83d\ude00""#);
    assert_eq!(&*text, "café 😀");
    assert_eq!(text, PromptText::new("café 😀"));
    // A lone surrogate cannot be a Rust string: the literal's inside is kept.
    let lone = completion(r#"{"model":"m","prompt":"a\ud800b"}"#).unwrap();
    let RequestInput::Completion(Prompt::Text(text)) = lone.input else {
        panic!("not text")
    };
    assert_eq!(text.as_str(), r"a\ud800b");
}

#[test]
fn invalid_escapes_in_a_skipped_prompt_are_still_rejected() {
    assert!(completion(r#"{"model":"m","prompt":"bad \q escape"}"#).is_err());
    assert!(completion("{\"model\":\"m\",\"prompt\":\"raw \u{1} control\"}").is_err());
}

#[test]
fn token_id_arrays_are_read_exactly() {
    assert_eq!(
        token_ids(" [ 0, 7 ,4294967295 ] "),
        Some(vec![0, 7, u32::MAX])
    );
    assert_eq!(token_ids("[]"), Some(vec![]));
    assert_eq!(token_ids("[ ]"), Some(vec![]));
    for bad in [
        "[4294967296]",
        "[1.5]",
        "[1e3]",
        "[-1]",
        "[01]",
        "[1,]",
        "[,1]",
        "[1 2]",
        "[\"1\"]",
        "[1]x",
    ] {
        assert_eq!(token_ids(bad), None, "{bad}");
    }
}
