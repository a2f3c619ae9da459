//! Chat templates rendered in process, the way `transformers.apply_chat_template` renders them
//! for vLLM: Jinja with `trim_blocks` and `lstrip_blocks` (minijinja), `raise_exception`,
//! `bos_token`/`eos_token` in the context, message contents in vLLM's "string" format, and
//! `continue_final_message` cutting the text right after the last message's content.
//!
//! Used by the router's local tokenizer (whose answers are checked against `/tokenize`, see
//! [`super::Tokenizer`]) and by the simulator, which must render exactly as the router does.
//!
//! Concurrency: a [`ChatTemplate`] is immutable once built; every method takes `&self`.

use serde_json::Value;

/// Why a template cannot be used for a request.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ChatTemplateError {
    #[error("invalid chat template: {0}")]
    Template(String),
    #[error("{0}")]
    Render(String),
}

/// The flags vLLM passes to `apply_chat_template`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatOptions {
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
}

/// A compiled chat template with the special tokens it may print.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, ChatTemplateError> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<(), minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned(NAME, source.into())
            .map_err(|e| ChatTemplateError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The prompt text of `messages`, as `apply_chat_template(tokenize=False)` returns it.
    pub fn render(
        &self,
        messages: &[Value],
        opts: ChatOptions,
    ) -> Result<String, ChatTemplateError> {
        let messages: Vec<Value> = messages.iter().map(normalize_message).collect();
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| ChatTemplateError::Template(e.to_string()))?;
        let ctx = minijinja::context! {
            messages => &messages,
            add_generation_prompt => opts.add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        let mut rendered = template
            .render(ctx)
            .map_err(|e| ChatTemplateError::Render(e.to_string()))?;
        if opts.continue_final_message {
            let final_content = messages
                .last()
                .and_then(|m| m.get("content"))
                .and_then(Value::as_str)
                .unwrap_or_default();
            // transformers: cut right after the final message's content.
            let stripped = final_content.trim();
            match rendered.rfind(stripped) {
                Some(loc) if !stripped.is_empty() => {
                    let lstripped = final_content.trim_start();
                    let end = if rendered[loc..].starts_with(lstripped) {
                        loc + lstripped.len()
                    } else {
                        loc + stripped.len()
                    };
                    rendered.truncate(end);
                }
                _ => {
                    return Err(ChatTemplateError::Render(
                        "continue_final_message is set but the final message does not appear \
                         in the chat history"
                            .into(),
                    ));
                }
            }
        }
        Ok(rendered)
    }
}

/// vLLM's "string" content format: a list of parts becomes their texts joined by newlines;
/// `null` content becomes empty.
fn normalize_message(message: &Value) -> Value {
    let mut message = message.clone();
    if let Some(obj) = message.as_object_mut() {
        let content = match obj.get("content") {
            Some(Value::Array(parts)) => Value::String(
                parts
                    .iter()
                    .filter_map(|p| match p {
                        Value::String(s) => Some(s.as_str()),
                        other => other.get("text").and_then(Value::as_str),
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
            Some(Value::Null) | None => Value::String(String::new()),
            Some(other) => other.clone(),
        };
        obj.insert("content".into(), content);
    }
    message
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<|start|>{{ m.role }}\n\
                            {{ m.content }}<|end|>\n{% endfor %}\
                            {% if add_generation_prompt %}<|start|>assistant\n{% endif %}";

    fn template() -> ChatTemplate {
        ChatTemplate::new(TEMPLATE, "<|bos|>", "<|eos|>").expect("compiles")
    }

    const GEN: ChatOptions = ChatOptions {
        add_generation_prompt: true,
        continue_final_message: false,
    };

    #[test]
    fn renders_messages_with_the_special_tokens_and_the_generation_prompt() {
        let msgs = [
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
            json!({"role": "assistant", "content": null}),
        ];
        let text = template().render(&msgs, GEN).expect("renders");
        assert_eq!(
            text,
            "<|bos|><|start|>system\nBe brief.<|end|>\n<|start|>user\na\nb<|end|>\n\
             <|start|>assistant\n<|end|>\n<|start|>assistant\n"
        );
        let no_gen = ChatOptions {
            add_generation_prompt: false,
            ..GEN
        };
        assert!(
            !template()
                .render(&msgs[..1], no_gen)
                .expect("renders")
                .ends_with("assistant\n")
        );
    }

    #[test]
    fn continue_final_message_stops_after_its_content() {
        let msgs = [
            json!({"role": "user", "content": "Hi"}),
            json!({"role": "assistant", "content": "The answer is"}),
        ];
        let opts = ChatOptions {
            add_generation_prompt: false,
            continue_final_message: true,
        };
        let text = template().render(&msgs, opts).expect("renders");
        assert!(
            text.ends_with("<|start|>assistant\nThe answer is"),
            "{text:?}"
        );
        let empty = [json!({"role": "assistant", "content": ""})];
        assert!(matches!(
            template().render(&empty, opts),
            Err(ChatTemplateError::Render(_))
        ));
    }

    #[test]
    fn a_bad_template_fails_to_build_and_raise_exception_fails_to_render() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", "", ""),
            Err(ChatTemplateError::Template(_))
        ));
        let raising = ChatTemplate::new("{{ raise_exception('nope') }}", "", "").expect("ok");
        let err = raising.render(&[], GEN).expect_err("raises");
        assert!(err.to_string().contains("nope"), "{err}");
    }
}
