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
fn a_percent_encoded_path_is_the_endpoint_it_decodes_to() {
    for (path, kind) in [
        ("/v1/%63ompletions", Some(EndpointKind::Completions)),
        (
            "/v1/chat%2Fcompletions",
            Some(EndpointKind::ChatCompletions),
        ),
        ("/v1/%6D%65ssages?x=%41", Some(EndpointKind::Messages)),
        ("%2Fv1%2Fresponses%2F", Some(EndpointKind::Responses)),
        ("/v1/%63ompletion", None),
        ("/v1/completions%3F", None),
        ("/v1/%ff%fe", None),
        ("/v1/%", None),
    ] {
        assert_eq!(EndpointKind::from_path(path), kind, "{path}");
    }
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
        "add_generation_prompt":false,"add_special_tokens":true,"stream":true,"cache_salt":"abc"}"#;
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
        input.tools.as_ref().map(RawJson::get),
        Some(r#"[{"type":"function","function":{"name":"f"}}]"#)
    );
    assert_eq!(
        input.chat_template_kwargs.as_ref().map(RawJson::get),
        Some(r#"{"enable_thinking":false}"#)
    );
    assert_eq!(input.add_generation_prompt, Some(false));
    assert_eq!(input.continue_final_message, None);
    assert_eq!(input.add_special_tokens, Some(true));
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

#[test]
fn members_are_found_by_decoded_name_and_read_once() {
    let req = completion(r#"{"mod\u0065l":"m","prompt":"x"}"#).unwrap();
    assert_eq!(req.model, "m");
    assert!(matches!(
        completion(r#"{"model":"m","prompt":"x","model":"n"}"#),
        Err(ParseError::DuplicateField("model"))
    ));
    assert!(matches!(
        completion(r#"{"model":"m","prompt":[1],"prompt":[2]}"#),
        Err(ParseError::DuplicateField("prompt"))
    ));
    // Members routing does not read may repeat, as serde allows.
    assert!(completion(r#"{"model":"m","prompt":"x","n":1,"n":2}"#).is_ok());
}

#[test]
fn small_members_of_the_wrong_type_are_named() {
    for (body, name) in [
        (r#"{"model":5,"prompt":"x"}"#, "model"),
        (r#"{"model":"m","prompt":"x","stream":"yes"}"#, "stream"),
        (
            r#"{"model":"m","prompt":"x","cache_salt":[1]}"#,
            "cache_salt",
        ),
    ] {
        match completion(body) {
            Err(ParseError::InvalidField { field, .. }) => assert_eq!(field, name, "{body}"),
            other => panic!("{body}: {other:?}"),
        }
    }
    assert!(completion(r#"{"model":"m","prompt":"x","stream":null}"#).is_ok());
}

#[test]
fn token_ids_followed_by_more_members_and_invalid_arrays() {
    let req = completion(r#"{"prompt": [ 5 ,6 ] ,"model":"m","max_tokens":3}"#).unwrap();
    assert!(matches!(req.input, RequestInput::Completion(Prompt::TokenIds(ref v)) if v == &[5, 6]));
    // Well-formed JSON that is not a token-id array is a bad prompt...
    for body in [
        r#"{"model":"m","prompt":[1.5]}"#,
        r#"{"model":"m","prompt":[1e3]}"#,
        r#"{"model":"m","prompt":[4294967296]}"#,
        r#"{"model":"m","prompt":[01]}"#,
    ] {
        assert!(
            matches!(
                completion(body),
                Err(ParseError::InvalidPrompt | ParseError::InvalidJson(_))
            ),
            "{body}"
        );
    }
    // ...and malformed JSON is malformed JSON.
    for body in [
        r#"{"model":"m","prompt":[1,]}"#,
        r#"{"model":"m","prompt":[1 2]}"#,
        r#"{"model":"m","prompt":[1]"#,
    ] {
        assert!(
            matches!(completion(body), Err(ParseError::InvalidJson(_))),
            "{body}"
        );
    }
}

#[test]
fn invalid_json_says_where() {
    let Err(ParseError::InvalidJson(error)) = completion(r#"{"model":"m","prompt":"x",}"#) else {
        panic!("accepted a trailing comma");
    };
    assert_eq!(error.offset, 26);
    assert!(error.to_string().contains("at byte 26"), "{error}");
    let Err(ParseError::InvalidJson(error)) =
        parse_request(EndpointKind::Completions, b"{\"model\":\"m\xff\"}")
    else {
        panic!("accepted invalid UTF-8");
    };
    assert_eq!((error.offset, error.what), (11, "invalid UTF-8"));
}

mod skimmer {
    use proptest::prelude::*;
    use serde::de::IgnoredAny;

    use super::super::skim;

    fn serde_accepts(text: &str) -> bool {
        serde_json::from_str::<IgnoredAny>(text).is_ok()
    }

    /// serde_json skips nested values without a depth limit (and without recursion); so does
    /// the skimmer.
    #[test]
    fn nesting_is_unlimited_and_never_overflows_the_stack() {
        for depth in [1, 63, 64, 65, 128, 129, 100_000] {
            for (open, close) in [("[", "]"), ("{\"a\":", "}")] {
                let text = format!("{}1{}", open.repeat(depth), close.repeat(depth));
                assert_eq!(
                    skim::validate(text.as_bytes()).is_ok(),
                    serde_accepts(&text),
                    "{open} × {depth}"
                );
                // The same value as a member of a request body.
                let body = format!(r#"{{"model":"m","prompt":"x","extra":{text}}}"#);
                let nested_ok = serde_json::from_str::<IgnoredAny>(&body).is_ok();
                assert_eq!(
                    super::completion(&body).is_ok(),
                    nested_ok,
                    "member {open} × {depth}"
                );
            }
        }
    }

    #[test]
    fn strings_across_the_sixty_four_byte_steps() {
        // Every position of a quote, an escape and a control character relative to the
        // vectorized steps, and bodies ending right after.
        for len in 0..140 {
            let plain = "a".repeat(len);
            for (inner, ok) in [
                (plain.clone(), true),
                (format!("{plain}\\\""), true),
                (format!("{plain}\\u00e9x"), true),
                (format!("{plain}\\u00g9"), false),
                (format!("{plain}\\q"), false),
                (format!("{plain}\u{1f}"), false),
                (format!("{plain}é\\n"), true),
            ] {
                let text = format!("\"{inner}\"");
                assert_eq!(skim::validate(text.as_bytes()).is_ok(), ok, "{text:?}");
                assert_eq!(serde_accepts(&text), ok, "serde disagrees on {text:?}");
                let unterminated = format!("\"{inner}");
                assert!(skim::validate(unterminated.as_bytes()).is_err());
            }
        }
    }

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            ".{0,40}".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
                proptest::collection::vec((".{0,8}", inner), 0..6)
                    .prop_map(|kv| { Value::Object(kv.into_iter().collect()) }),
            ]
        })
    }

    /// Bytes that JSON's grammar turns on, so that random edits hit its edges.
    const GRAMMAR: &[u8] = b"{}[]\":,-+.0123456789eE \n\\/bfnrtuaxl\x01";

    proptest! {
        /// The skimmer accepts exactly what serde_json accepts: on documents serde wrote, and on
        /// the same documents with one byte inserted, removed or replaced.
        #[test]
        fn agrees_with_serde_json(
            value in json_value(),
            pretty in any::<bool>(),
            edit in proptest::option::of((any::<prop::sample::Index>(), 0u8..3, prop::sample::select(GRAMMAR))),
        ) {
            let mut text = if pretty {
                serde_json::to_string_pretty(&value).unwrap()
            } else {
                value.to_string()
            };
            prop_assert!(skim::validate(text.as_bytes()).is_ok(), "{text}");
            if let Some((at, kind, byte)) = edit {
                let boundaries: Vec<usize> =
                    (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
                let at = boundaries[at.index(boundaries.len())];
                let next = text[at..].chars().next().map_or(at, |c| at + c.len_utf8());
                let byte = char::from(byte).to_string();
                match kind {
                    0 => text.insert_str(at, &byte),
                    1 => text.replace_range(at..next, ""),
                    _ => text.replace_range(at..next, &byte),
                }
                prop_assert_eq!(skim::validate(text.as_bytes()).is_ok(), serde_accepts(&text), "{}", text);
            }
        }

        /// Long strings thick with backslashes, quotes and hex digits, so that escapes straddle
        /// the 64-byte steps.
        #[test]
        fn agrees_with_serde_json_on_escape_heavy_strings(
            bytes in proptest::collection::vec(prop::sample::select(b"\\\\\\\"u0aF9n\x1fz".to_vec()), 0..300),
        ) {
            let text = format!("[\"{}\"]", String::from_utf8(bytes).unwrap());
            prop_assert_eq!(skim::validate(text.as_bytes()).is_ok(), serde_accepts(&text), "{:?}", text);
        }

        /// Short strings over JSON's own alphabet: mostly malformed, sometimes not.
        #[test]
        fn agrees_with_serde_json_on_fragments(bytes in proptest::collection::vec(prop::sample::select(GRAMMAR), 0..24)) {
            let text = String::from_utf8(bytes).unwrap();
            prop_assert_eq!(skim::validate(text.as_bytes()).is_ok(), serde_accepts(&text), "{:?}", text);
        }
    }
}
