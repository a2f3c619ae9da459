//! The OpenAI-compatible HTTP server, with vLLM's routes, JSON shapes, statuses and errors.
//!
//! Concurrency: axum runs each request as its own task; they share an immutable [`AppState`]
//! behind an `Arc` (tokenizer, names, engine handle). A generation request tokenizes in its
//! handler, submits to the engine task and reads its own output channel; streaming responses
//! turn that channel into SSE frames. Dropping the response (client gone) closes the channel,
//! which the engine notices and frees the request's blocks.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt as _;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::engine::{EngineHandle, Finished, Output, Submit};
use crate::error::ApiError;
use crate::lora::LoraAdapter;
use crate::metrics::{self, MetricsInfo};
use crate::publisher::Faults;
use crate::tokenizer::{ChatOptions, SimTokenizer, TokenizerError};

/// The response header naming the replica that served a request.
pub const REPLICA_HEADER: &str = "x-llmgw-sim-replica";

/// Everything the handlers share.
pub struct AppState {
    pub names: Vec<String>,
    /// LoRA adapters (`--lora-modules`), served under their own names.
    pub adapters: Vec<Arc<LoraAdapter>>,
    pub root: String,
    pub max_model_len: usize,
    pub tokenizer: Arc<SimTokenizer>,
    pub engine: EngineHandle,
    pub faults: Arc<Faults>,
    pub metrics: MetricsInfo,
    pub replica: HeaderValue,
    pub created: u64,
    pub next_id: AtomicU64,
    /// Milliseconds added before every `/tokenize` answer (`--sim-tokenize-delay-ms`, changed
    /// at run time by `POST /sim/tokenize_delay`), to test routers' tokenization deadlines.
    pub tokenize_delay_ms: AtomicU64,
}

impl AppState {
    fn served(&self) -> &str {
        self.names.first().map_or("", String::as_str)
    }

    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        self.resolve_model(model).map(|_| ())
    }

    /// The adapter a request's `model` names (`None`: the base model), or vLLM's 404 for a
    /// name it does not serve. An adapter's name wins over a base name, as in vLLM's
    /// `_maybe_get_adapters`.
    fn resolve_model(&self, model: Option<&str>) -> Result<Option<Arc<LoraAdapter>>, ApiError> {
        let Some(m) = model else {
            return Ok(None);
        };
        if let Some(adapter) = self.adapters.iter().find(|a| a.name == m) {
            return Ok(Some(Arc::clone(adapter)));
        }
        if self.names.iter().any(|n| n == m) {
            Ok(None)
        } else {
            Err(ApiError::model_not_found(m))
        }
    }

    fn request_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let salt = self.created.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        format!("{prefix}-{:016x}{:016x}", salt ^ n, n)
    }
}

/// All routes, with the replica header on every response.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(messages))
        .route("/v1/responses", post(responses))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ping", get(health).post(health))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/metrics", get(metrics_text))
        .route("/debug/blocks", get(debug_blocks))
        .route("/sim/restart", post(sim_restart))
        .route("/sim/stall", post(sim_stall))
        .route("/sim/tokenize_delay", post(sim_tokenize_delay))
        .route("/sim/drop_seqs", post(sim_drop_seqs))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::map_response_with_state(
            Arc::clone(&state),
            add_replica_header,
        ))
        .with_state(state)
}

async fn add_replica_header(State(state): State<Arc<AppState>>, mut res: Response) -> Response {
    res.headers_mut()
        .insert(REPLICA_HEADER, state.replica.clone());
    res
}

async fn not_found() -> Response {
    (StatusCode::NOT_FOUND, Json(json!({"detail": "Not Found"}))).into_response()
}

async fn method_not_allowed() -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        Json(json!({"detail": "Method Not Allowed"})),
    )
        .into_response()
}

// ---------------------------------------------------------------------------------------------
// Request parsing

/// Parses a JSON body into `T`, answering as vLLM (FastAPI + pydantic) does: 400 for
/// malformed JSON and for missing or mistyped fields.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "[{{'type': 'json_invalid', 'loc': ('body', {}), 'msg': 'JSON decode error', \
             'ctx': {{'error': '{e}'}}}}]",
            e.column()
        ))
    })?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "[{'type': 'model_attributes_type', 'loc': ('body',), 'msg': 'Input should be a \
             valid dictionary or object to extract fields from'}]",
        ));
    }
    serde_json::from_value(value)
        .map_err(|e| ApiError::bad_request(format!("1 validation error: {e}")))
}

#[derive(Debug, Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// What completions and chats share after the prompt: how much to generate, and how to answer.
#[derive(Debug, Deserialize)]
struct Sampling {
    model: Option<String>,
    max_tokens: Option<i64>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    cache_salt: Option<String>,
    n: Option<i64>,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: Value,
    #[serde(default = "yes")]
    add_special_tokens: bool,
    #[serde(flatten)]
    sampling: Sampling,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<Value>,
    max_completion_tokens: Option<i64>,
    #[serde(default = "yes")]
    add_generation_prompt: bool,
    #[serde(default)]
    continue_final_message: bool,
    #[serde(default)]
    add_special_tokens: bool,
    #[serde(flatten)]
    sampling: Sampling,
}

fn yes() -> bool {
    true
}

fn tokenizer_error(e: TokenizerError) -> ApiError {
    match e {
        TokenizerError::Load(_) | TokenizerError::Template(_) => ApiError::internal(e.to_string()),
        _ => ApiError::bad_request(e.to_string()),
    }
}

impl AppState {
    /// A completion prompt: text, or token ids (a list holding one of either is accepted too).
    fn prompt_tokens(&self, prompt: &Value, add_special: bool) -> Result<Vec<u32>, ApiError> {
        let bad = || {
            ApiError::bad_request(
                "prompt must be a string, a list of token ids, or a list holding one of those \
                 (llmgw-sim serves one prompt per request)",
            )
            .with_param("prompt")
        };
        match prompt {
            Value::String(s) => self
                .tokenizer
                .encode(s, add_special)
                .map_err(tokenizer_error),
            Value::Array(items) => match items.as_slice() {
                [one @ (Value::String(_) | Value::Array(_))] => {
                    self.prompt_tokens(one, add_special)
                }
                ids => ids
                    .iter()
                    .map(|v| {
                        v.as_u64()
                            .and_then(|id| u32::try_from(id).ok())
                            .filter(|&id| id < self.tokenizer.vocab_size())
                            .ok_or_else(bad)
                    })
                    .collect(),
            },
            _ => Err(bad()),
        }
    }

    fn chat_tokens(&self, messages: &[Value], opts: ChatOptions) -> Result<Vec<u32>, ApiError> {
        if opts.add_generation_prompt && opts.continue_final_message {
            return Err(ApiError::bad_request(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            ));
        }
        for m in messages {
            if m.get("role").and_then(Value::as_str).is_none() {
                return Err(ApiError::bad_request(
                    "each message must be an object with a string `role`",
                )
                .with_param("messages"));
            }
        }
        self.tokenizer
            .encode_chat(messages, opts)
            .map_err(tokenizer_error)
    }

    /// vLLM's length checks; returns max_tokens.
    fn validate(
        &self,
        prompt_len: usize,
        max_tokens: Option<i64>,
        default: Option<usize>,
        cache_salt: Option<&str>,
        n: Option<i64>,
    ) -> Result<usize, ApiError> {
        if prompt_len == 0 {
            return Err(ApiError::bad_request("Prompt cannot be empty").with_param("prompt"));
        }
        if cache_salt == Some("") {
            return Err(ApiError::bad_request(
                "Parameter 'cache_salt' must be a non-empty string if provided.",
            )
            .with_param("cache_salt"));
        }
        if n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad_request("llmgw-sim supports n=1 only").with_param("n"));
        }
        let limit = self.max_model_len;
        if prompt_len >= limit {
            return Err(ApiError::bad_request(format!(
                "This model's maximum context length is {limit} tokens. However, your request \
                 has {prompt_len} input tokens. Please reduce the length of the input messages."
            ))
            .with_param("input_tokens"));
        }
        let max_tokens = match max_tokens {
            Some(m) if m < 1 => {
                return Err(ApiError::bad_request(format!(
                    "max_tokens must be at least 1, got {m}."
                ))
                .with_param("max_tokens"));
            }
            Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
            None => default.unwrap_or(limit - prompt_len),
        };
        if max_tokens > limit - prompt_len {
            return Err(ApiError::bad_request(format!(
                "'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This \
                 model's maximum context length is {limit} tokens and your request has \
                 {prompt_len} input tokens ({max_tokens} > {limit} - {prompt_len})."
            ))
            .with_param("max_tokens"));
        }
        Ok(max_tokens)
    }
}

// ---------------------------------------------------------------------------------------------
// Generation

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
    /// Anthropic's `/v1/messages`, as vLLM answers it.
    Messages,
    /// OpenAI's `/v1/responses`, as vLLM answers it.
    Responses,
}

struct Generation {
    api: Api,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// `/v1/responses` stream events are numbered.
    sequence: AtomicU64,
    /// The text streamed so far (`/v1/responses` repeats it whole at the end).
    streamed: parking_lot::Mutex<String>,
}

impl Generation {
    fn usage(f: &Finished) -> Value {
        json!({
            "prompt_tokens": f.prompt_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens,
            "completion_tokens": f.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
        })
    }

    fn full(&self, text: String, f: &Finished) -> Value {
        match self.api {
            Api::Completions => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": f.reason.as_str(),
                    "stop_reason": null,
                    "prompt_logprobs": null,
                }],
                "service_tier": null,
                "system_fingerprint": null,
                "usage": Self::usage(f),
                "kv_transfer_params": null,
            }),
            Api::Chat => json!({
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": null,
                        "annotations": null,
                        "audio": null,
                        "function_call": null,
                        "tool_calls": [],
                        "reasoning_content": null,
                    },
                    "logprobs": null,
                    "finish_reason": f.reason.as_str(),
                    "stop_reason": null,
                }],
                "service_tier": null,
                "system_fingerprint": null,
                "usage": Self::usage(f),
                "prompt_logprobs": null,
                "kv_transfer_params": null,
            }),
            Api::Messages => json!({
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": text}],
                "model": self.model,
                "stop_reason": Self::stop_reason(f),
                "stop_sequence": null,
                "usage": Self::messages_usage(f),
            }),
            Api::Responses => self.response(Some((text, f))),
        }
    }

    /// A `/v1/responses` response object: in progress (`None`), or finished with its text.
    fn response(&self, done: Option<(String, &Finished)>) -> Value {
        let (status, incomplete, output, usage) = match done {
            None => ("in_progress", Value::Null, json!([]), Value::Null),
            Some((text, f)) => {
                let length = f.reason.as_str() == "length";
                (
                    if length { "incomplete" } else { "completed" },
                    if length {
                        json!({"reason": "max_output_tokens"})
                    } else {
                        Value::Null
                    },
                    json!([self.output_message(&text, "completed")]),
                    json!({
                        "input_tokens": f.prompt_tokens,
                        "input_tokens_details": {"cached_tokens": f.cached_tokens},
                        "output_tokens": f.completion_tokens,
                        "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": f.prompt_tokens + f.completion_tokens,
                    }),
                )
            }
        };
        json!({
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": incomplete,
            "instructions": null,
            "metadata": null,
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": true,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "background": false,
            "previous_response_id": null,
            "reasoning": null,
            "service_tier": "auto",
            "status": status,
            "text": null,
            "truncation": "disabled",
            "usage": usage,
        })
    }

    /// The one output message of a `/v1/responses` answer.
    fn output_message(&self, text: &str, status: &str) -> Value {
        let content = if status == "completed" {
            json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": null}])
        } else {
            json!([])
        };
        json!({
            "id": format!("msg_{}", self.id),
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        })
    }

    /// One `/v1/responses` stream event, numbered.
    fn response_event(&self, name: &str, mut data: Value) -> Bytes {
        data["type"] = Value::from(name);
        data["sequence_number"] = Value::from(self.sequence.fetch_add(1, Ordering::Relaxed));
        Self::event(name, &data)
    }

    /// Anthropic's names for why generation stopped.
    fn stop_reason(f: &Finished) -> &'static str {
        match f.reason.as_str() {
            "length" => "max_tokens",
            _ => "end_turn",
        }
    }

    fn messages_usage(f: &Finished) -> Value {
        json!({
            "input_tokens": f.prompt_tokens,
            "output_tokens": f.completion_tokens,
            "cache_read_input_tokens": f.cached_tokens,
        })
    }

    /// One Anthropic stream event.
    fn event(name: &str, data: &Value) -> Bytes {
        Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
    }

    /// What a stream starts with: the role's chunk, or Anthropic's message and block starts.
    fn first_frame(&self) -> Option<Bytes> {
        match self.api {
            Api::Completions => None,
            Api::Chat => Some(sse(&self.chunk(json!({
                "index": 0, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": null,
            })))),
            Api::Messages => {
                let mut out = Self::event(
                    "message_start",
                    &json!({"type": "message_start", "message": {
                        "id": self.id, "type": "message", "role": "assistant", "content": [],
                        "model": self.model, "stop_reason": null, "stop_sequence": null,
                        "usage": {"input_tokens": 0, "output_tokens": 0},
                    }}),
                )
                .to_vec();
                out.extend_from_slice(&Self::event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}),
                ));
                Some(Bytes::from(out))
            }
            Api::Responses => {
                let mut out = self
                    .response_event("response.created", json!({"response": self.response(None)}))
                    .to_vec();
                for (name, data) in [
                    (
                        "response.in_progress",
                        json!({"response": self.response(None)}),
                    ),
                    (
                        "response.output_item.added",
                        json!({"output_index": 0, "item": self.output_message("", "in_progress")}),
                    ),
                    (
                        "response.content_part.added",
                        json!({"output_index": 0, "content_index": 0,
                            "item_id": format!("msg_{}", self.id),
                            "part": {"type": "output_text", "text": "", "annotations": []}}),
                    ),
                ] {
                    out.extend_from_slice(&self.response_event(name, data));
                }
                Some(Bytes::from(out))
            }
        }
    }

    /// One token's text in the stream.
    fn delta_frame(&self, text: &str) -> Bytes {
        match self.api {
            Api::Messages => Self::event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": text}}),
            ),
            Api::Responses => {
                self.streamed.lock().push_str(text);
                self.response_event(
                    "response.output_text.delta",
                    json!({"output_index": 0, "content_index": 0,
                    "item_id": format!("msg_{}", self.id), "delta": text, "logprobs": []}),
                )
            }
            _ => sse(&self.delta(text, None)),
        }
    }

    /// The last token's text, and how the stream ends.
    fn last_frames(&self, text: &str, f: &Finished) -> Bytes {
        let mut out = Vec::new();
        match self.api {
            Api::Messages => {
                if !text.is_empty() {
                    out.extend_from_slice(&self.delta_frame(text));
                }
                out.extend_from_slice(&Self::event(
                    "content_block_stop",
                    &json!({"type": "content_block_stop", "index": 0}),
                ));
                out.extend_from_slice(&Self::event(
                    "message_delta",
                    &json!({"type": "message_delta",
                        "delta": {"stop_reason": Self::stop_reason(f), "stop_sequence": null},
                        "usage": Self::messages_usage(f)}),
                ));
                out.extend_from_slice(&Self::event(
                    "message_stop",
                    &json!({"type": "message_stop"}),
                ));
            }
            Api::Responses => {
                if !text.is_empty() {
                    out.extend_from_slice(&self.delta_frame(text));
                }
                let whole = self.streamed.lock().clone();
                let item_id = format!("msg_{}", self.id);
                let part = json!({"type": "output_text", "text": whole, "annotations": []});
                for (name, data) in [
                    (
                        "response.output_text.done",
                        json!({"output_index": 0, "content_index": 0, "item_id": item_id,
                            "text": whole, "logprobs": []}),
                    ),
                    (
                        "response.content_part.done",
                        json!({"output_index": 0, "content_index": 0, "item_id": item_id,
                            "part": part}),
                    ),
                    (
                        "response.output_item.done",
                        json!({"output_index": 0,
                            "item": self.output_message(&whole, "completed")}),
                    ),
                    (
                        "response.completed",
                        json!({"response": self.response(Some((whole.clone(), f)))}),
                    ),
                ] {
                    out.extend_from_slice(&self.response_event(name, data));
                }
            }
            _ => {
                out.extend_from_slice(&sse(&self.delta(text, Some(f.reason.as_str()))));
                if self.include_usage {
                    out.extend_from_slice(&sse(&self.usage_chunk(f)));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
            }
        }
        Bytes::from(out)
    }

    fn chunk(&self, choice: Value) -> Value {
        let object = match self.api {
            Api::Completions => "text_completion",
            Api::Chat | Api::Messages | Api::Responses => "chat.completion.chunk",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    fn delta(&self, text: &str, finish: Option<&str>) -> Value {
        match self.api {
            Api::Completions => self.chunk(json!({
                "index": 0, "text": text, "logprobs": null,
                "finish_reason": finish, "stop_reason": null,
            })),
            Api::Chat | Api::Messages | Api::Responses => self.chunk(json!({
                "index": 0, "delta": {"content": text}, "logprobs": null,
                "finish_reason": finish, "stop_reason": null,
            })),
        }
    }

    fn usage_chunk(&self, f: &Finished) -> Value {
        let mut v = self.chunk(Value::Null);
        v["choices"] = json!([]);
        v["usage"] = Self::usage(f);
        v
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// What to generate, and for whom.
struct GenerateRequest {
    prompt: Vec<u32>,
    max_tokens: usize,
    cache_salt: Option<String>,
    /// The adapter serving it (`None`: the base model).
    lora: Option<Arc<LoraAdapter>>,
    stream: bool,
    include_usage: bool,
}

async fn generate(
    state: Arc<AppState>,
    api: Api,
    req: GenerateRequest,
) -> Result<Response, ApiError> {
    let GenerateRequest {
        prompt,
        max_tokens,
        cache_salt,
        lora,
        stream,
        include_usage,
    } = req;
    // vLLM names the adapter in responses to its requests.
    let model = lora
        .as_ref()
        .map_or_else(|| state.served().to_owned(), |a| a.name.clone());
    let (tx, mut rx) = mpsc::unbounded_channel();
    state
        .engine
        .submit(Submit {
            prompt,
            max_tokens,
            cache_salt,
            lora,
            out: tx,
        })
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let prefix = match api {
        Api::Completions => "cmpl",
        Api::Chat => "chatcmpl",
        Api::Messages => "msg",
        Api::Responses => "resp",
    };
    let resp = Generation {
        api,
        id: state.request_id(prefix),
        created: unix_secs(),
        model,
        include_usage,
        sequence: AtomicU64::new(0),
        streamed: parking_lot::Mutex::default(),
    };
    if !stream {
        let mut tokens = Vec::new();
        while let Some(out) = rx.recv().await {
            match out {
                Output::Token(t) => tokens.push(t),
                Output::Finished(f) => {
                    let text = state.tokenizer.decode(&tokens).unwrap_or_default();
                    return Ok(Json(resp.full(text, &f)).into_response());
                }
                Output::Failed(msg) => return Err(ApiError::internal(msg)),
            }
        }
        return Err(ApiError::internal("the engine dropped the request"));
    }

    // Streaming: one chunk per token; the last token's chunk carries finish_reason.
    let tokenizer = Arc::clone(&state.tokenizer);
    let first = resp.first_frame();
    let body = futures::stream::unfold(
        (rx, resp, None::<u32>, false),
        move |(mut rx, resp, mut held, done)| {
            let tokenizer = Arc::clone(&tokenizer);
            async move {
                if done {
                    return None;
                }
                loop {
                    match rx.recv().await {
                        Some(Output::Token(t)) => {
                            // Hold one token back so the final one can carry finish_reason.
                            if let Some(prev) = held.replace(t) {
                                let text = tokenizer.decode(&[prev]).unwrap_or_default();
                                let frame = resp.delta_frame(&text);
                                return Some((frame, (rx, resp, held, false)));
                            }
                        }
                        Some(Output::Finished(f)) => {
                            let text = held
                                .take()
                                .map(|t| tokenizer.decode(&[t]).unwrap_or_default())
                                .unwrap_or_default();
                            let frames = resp.last_frames(&text, &f);
                            return Some((frames, (rx, resp, None, true)));
                        }
                        Some(Output::Failed(msg)) => {
                            let mut out = sse(&ApiError::internal(msg).body()).to_vec();
                            out.extend_from_slice(b"data: [DONE]\n\n");
                            return Some((Bytes::from(out), (rx, resp, None, true)));
                        }
                        None => return None,
                    }
                }
            }
        },
    );
    let body = futures::stream::iter(first)
        .chain(body)
        .map(Ok::<Bytes, std::convert::Infallible>);
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}

fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let result = async {
        let req: CompletionRequest = parse(&body)?;
        let lora = state.resolve_model(req.sampling.model.as_deref())?;
        let prompt = state.prompt_tokens(&req.prompt, req.add_special_tokens)?;
        let requested = req.sampling.max_tokens;
        respond(
            &state,
            (Api::Completions, req.sampling, lora),
            prompt,
            requested,
            Some(16),
        )
        .await
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let result = async {
        let req: ChatRequest = parse(&body)?;
        let lora = state.resolve_model(req.sampling.model.as_deref())?;
        let prompt = state.chat_tokens(
            &req.messages,
            ChatOptions {
                add_generation_prompt: req.add_generation_prompt,
                continue_final_message: req.continue_final_message,
                add_special_tokens: req.add_special_tokens,
            },
        )?;
        let requested = req.max_completion_tokens.or(req.sampling.max_tokens);
        respond(
            &state,
            (Api::Chat, req.sampling, lora),
            prompt,
            requested,
            None,
        )
        .await
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// A request of an API the router converts into a chat (`/v1/messages`, `/v1/responses`):
/// its conversation rendered with the template as the conversion says, generated like a chat,
/// answered in `api`'s shape.
async fn generate_converted(
    state: &Arc<AppState>,
    api: Api,
    parsed: &llmgw::openai::ParsedRequest,
    max_tokens: Option<i64>,
) -> Result<Response, ApiError> {
    let lora = state.resolve_model(Some(&parsed.model))?;
    let llmgw::openai::RequestInput::Chat(chat) = &parsed.input else {
        return Err(ApiError::internal("a converted request is a chat"));
    };
    let conversation: Vec<Value> =
        serde_json::from_str(chat.messages.get()).map_err(|e| ApiError::internal(e.to_string()))?;
    let prompt = state.chat_tokens(
        &conversation,
        ChatOptions {
            add_generation_prompt: chat.add_generation_prompt.unwrap_or(true),
            continue_final_message: chat.continue_final_message.unwrap_or(false),
            // vLLM adds them on top of the template's for a Responses prompt.
            add_special_tokens: chat.add_special_tokens.unwrap_or(false),
        },
    )?;
    let sampling = Sampling {
        model: Some(parsed.model.clone()),
        max_tokens,
        stream: parsed.stream,
        stream_options: None,
        cache_salt: parsed.cache_salt.clone(),
        n: None,
    };
    respond(state, (api, sampling, lora), prompt, max_tokens, None).await
}

/// `/v1/messages`: the conversation as vLLM renders it (the router's own conversion, checked
/// against vLLM's in the router's tests), generated like a chat, answered in Anthropic's shape;
/// errors too.
async fn messages(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    #[derive(Deserialize)]
    struct Limits {
        max_tokens: Option<i64>,
    }
    let result = async {
        let parsed = llmgw::openai::parse_request(llmgw::openai::EndpointKind::Messages, &body)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let limits: Limits = parse(&body)?;
        generate_converted(&state, Api::Messages, &parsed, limits.max_tokens).await
    }
    .await;
    result.unwrap_or_else(|e| e.into_anthropic_response())
}

/// `/v1/responses`: the conversation as vLLM renders it (the router's own conversion, checked
/// against vLLM's in the router's tests), generated like a chat, answered in the Responses
/// API's shape (JSON, or its SSE events when `stream` is set).
async fn responses(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    #[derive(Deserialize)]
    struct Limits {
        max_output_tokens: Option<i64>,
    }
    let result = async {
        let parsed = llmgw::openai::parse_request(llmgw::openai::EndpointKind::Responses, &body)
            .map_err(|e| ApiError::bad_request(e.to_string()).with_param("input"))?;
        let limits: Limits = parse(&body)?;
        if let llmgw::openai::RequestInput::Chat(chat) = &parsed.input
            && chat.unreproducible == Some("previous_response_id")
        {
            // Nothing is stored here (vLLM without VLLM_ENABLE_RESPONSES_API_STORE).
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: "Response with id not found.".into(),
                param: Some("previous_response_id".into()),
            });
        }
        generate_converted(&state, Api::Responses, &parsed, limits.max_output_tokens).await
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// Validates a request's generation settings against its prompt and generates the answer:
/// `requested` tokens at most, `default` when the request names none.
async fn respond(
    state: &Arc<AppState>,
    (api, sampling, lora): (Api, Sampling, Option<Arc<LoraAdapter>>),
    prompt: Vec<u32>,
    requested: Option<i64>,
    default: Option<usize>,
) -> Result<Response, ApiError> {
    let max_tokens = state.validate(
        prompt.len(),
        requested,
        default,
        sampling.cache_salt.as_deref(),
        sampling.n,
    )?;
    let include_usage = sampling.stream_options.unwrap_or_default().include_usage;
    generate(
        Arc::clone(state),
        api,
        GenerateRequest {
            prompt,
            max_tokens,
            cache_salt: sampling.cache_salt,
            lora,
            stream: sampling.stream,
            include_usage,
        },
    )
    .await
}

// ---------------------------------------------------------------------------------------------
// Tokenizer endpoints

#[derive(Debug, Deserialize)]
struct TokenizeCompletion {
    model: Option<String>,
    prompt: String,
    #[serde(default = "yes")]
    add_special_tokens: bool,
    #[serde(default)]
    return_token_strs: bool,
}

#[derive(Debug, Deserialize)]
struct TokenizeChat {
    model: Option<String>,
    messages: Vec<Value>,
    #[serde(default = "yes")]
    add_generation_prompt: bool,
    #[serde(default)]
    continue_final_message: bool,
    #[serde(default)]
    add_special_tokens: bool,
    #[serde(default)]
    return_token_strs: bool,
}

async fn tokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let delay = state.tokenize_delay_ms.load(Ordering::Relaxed);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let result = (|| {
        let probe: Value = parse(&body)?;
        let (tokens, strs) = if probe.get("messages").is_some() {
            let req: TokenizeChat = parse(&body)?;
            state.check_model(req.model.as_deref())?;
            let opts = ChatOptions {
                add_generation_prompt: req.add_generation_prompt,
                continue_final_message: req.continue_final_message,
                add_special_tokens: req.add_special_tokens,
            };
            (
                state.chat_tokens(&req.messages, opts)?,
                req.return_token_strs,
            )
        } else {
            let req: TokenizeCompletion = parse(&body)?;
            state.check_model(req.model.as_deref())?;
            let tokens = state
                .tokenizer
                .encode(&req.prompt, req.add_special_tokens)
                .map_err(tokenizer_error)?;
            (tokens, req.return_token_strs)
        };
        let token_strs = strs.then(|| state.tokenizer.token_strs(&tokens));
        Ok::<_, ApiError>(Json(json!({
            "count": tokens.len(),
            "max_model_len": state.max_model_len,
            "tokens": tokens,
            "token_strs": token_strs,
        })))
    })();
    result.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<i64>,
}

async fn detokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let result = (|| {
        let req: DetokenizeRequest = parse(&body)?;
        state.check_model(req.model.as_deref())?;
        let ids = req
            .tokens
            .iter()
            .map(|&t| {
                u32::try_from(t).map_err(|_| {
                    ApiError::bad_request(format!("token id {t} is out of vocabulary"))
                        .with_param("tokens")
                })
            })
            .collect::<Result<Vec<u32>, _>>()?;
        let prompt = state.tokenizer.decode(&ids).map_err(tokenizer_error)?;
        Ok::<_, ApiError>(Json(json!({ "prompt": prompt })))
    })();
    result.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

// ---------------------------------------------------------------------------------------------
// Server endpoints

/// `/v1/models`: the base model's names, then each LoRA adapter (vLLM's `show_available_models`:
/// an adapter's `root` is its path, its `parent` its `base_model_name` or the first served name,
/// its `max_model_len` null).
async fn models(State(state): State<Arc<AppState>>) -> Response {
    let card = |id: &str, root: &str, parent: Option<&str>, max_model_len: Option<usize>| {
        json!({
            "id": id,
            "object": "model",
            "created": state.created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
            "permission": [{
                "id": format!("modelperm-{:032x}", state.created),
                "object": "model_permission",
                "created": state.created,
                "allow_create_engine": false,
                "allow_sampling": true,
                "allow_logprobs": true,
                "allow_search_indices": false,
                "allow_view": true,
                "allow_fine_tuning": false,
                "organization": "*",
                "group": null,
                "is_blocking": false,
            }],
        })
    };
    let base = state
        .names
        .iter()
        .map(|name| card(name, &state.root, None, Some(state.max_model_len)));
    let adapters = state.adapters.iter().map(|a| {
        let parent = a.base_model_name.as_deref().unwrap_or(state.served());
        card(&a.name, &a.path, Some(parent), None)
    });
    let data: Vec<Value> = base.chain(adapters).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn health() -> Response {
    StatusCode::OK.into_response()
}

async fn reset_prefix_cache(State(state): State<Arc<AppState>>) -> Response {
    match state.engine.reset_prefix_cache().await {
        Ok(true) => StatusCode::OK.into_response(),
        Ok(false) => {
            tracing::warn!("reset_prefix_cache refused: requests hold KV blocks");
            StatusCode::OK.into_response()
        }
        Err(e) => ApiError::internal(e.to_string()).into_response(),
    }
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    let text = metrics::render(
        &state.metrics,
        &state.engine.stats(),
        &state.engine.lora_info(),
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn debug_blocks(State(state): State<Arc<AppState>>) -> Response {
    match state.engine.cached_hashes().await {
        Ok(hashes) => Json(json!({"count": hashes.len(), "block_hashes": hashes})).into_response(),
        Err(e) => ApiError::internal(e.to_string()).into_response(),
    }
}

async fn sim_restart(State(state): State<Arc<AppState>>) -> Response {
    match state.engine.restart() {
        Ok(()) => Json(json!({"ok": true})).into_response(),
        Err(e) => ApiError::internal(e.to_string()).into_response(),
    }
}

#[derive(Debug, Deserialize)]
struct StallRequest {
    ms: u64,
}

/// The longest stall `/sim/stall` accepts: a fault for tests, not a way to wedge a sim for hours.
const MAX_STALL_MS: u64 = 60_000;

async fn sim_stall(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let result = parse::<StallRequest>(&body).and_then(|req| {
        if req.ms > MAX_STALL_MS {
            return Err(ApiError::bad_request(format!(
                "ms must be at most {MAX_STALL_MS}, got {}",
                req.ms
            )));
        }
        state
            .engine
            .stall(Duration::from_millis(req.ms))
            .map_err(|e| ApiError::internal(e.to_string()))
    });
    match result {
        Ok(()) => Json(json!({"ok": true})).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `{"ms": N}`: every later `/tokenize` answer waits N ms first (0: none).
async fn sim_tokenize_delay(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match parse::<StallRequest>(&body) {
        Ok(req) if req.ms <= MAX_STALL_MS => {
            state.tokenize_delay_ms.store(req.ms, Ordering::Relaxed);
            Json(json!({"ok": true})).into_response()
        }
        Ok(req) => {
            ApiError::bad_request(format!("ms must be at most {MAX_STALL_MS}, got {}", req.ms))
                .into_response()
        }
        Err(e) => e.into_response(),
    }
}

#[derive(Debug, Deserialize)]
struct DropRequest {
    from: u64,
    to: u64,
}

async fn sim_drop_seqs(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match parse::<DropRequest>(&body) {
        Ok(req) if req.from <= req.to => {
            state.faults.drop_seqs(req.from..=req.to);
            Json(json!({"ok": true})).into_response()
        }
        Ok(_) => ApiError::bad_request("from must not exceed to").into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;

    use llmgw::blockhash::{BlockHasher, HashSettings};
    use proptest::prelude::*;

    use super::*;
    use crate::engine::{Engine, EngineConfig, LatencyModel};

    /// Handler state over a fresh engine (call inside a runtime).
    fn test_state(adapters: Vec<Arc<LoraAdapter>>) -> AppState {
        let tokenizer = Arc::new(SimTokenizer::builtin().unwrap());
        let max_loras = (!adapters.is_empty()).then_some(1);
        let engine = Engine::spawn(
            EngineConfig {
                num_blocks: 64,
                max_num_seqs: 4,
                prefix_caching: true,
                kv_events: false,
                latency: LatencyModel::default(),
                output_len: 3,
                hasher: BlockHasher::new(&HashSettings::sha256_cbor(
                    NonZeroUsize::new(16).unwrap(),
                    None,
                ))
                .unwrap(),
                vocab: tokenizer.word_ids().into(),
                data_parallel_rank: 0,
                max_loras,
            },
            None,
        );
        AppState {
            names: vec!["tiny".into(), "alias".into()],
            adapters,
            root: "org/tiny".into(),
            max_model_len: 128,
            tokenizer,
            engine,
            faults: Arc::new(Faults::default()),
            metrics: MetricsInfo {
                model_name: "tiny".into(),
                engine: "0".into(),
                block_size: 16,
                num_gpu_blocks: 64,
                prefix_caching: true,
                hash_algo: "sha256_cbor".into(),
                created: 0.0,
                max_loras,
            },
            replica: HeaderValue::from_static("test"),
            created: 0,
            next_id: AtomicU64::new(0),
            tokenize_delay_ms: AtomicU64::new(0),
        }
    }

    #[tokio::test]
    async fn adapters_are_listed_after_the_base_model_and_served_by_name() {
        let adapter = |id: u32, name: &str, base: Option<&str>| {
            Arc::new(LoraAdapter {
                id,
                name: name.into(),
                path: format!("/adapters/{name}"),
                base_model_name: base.map(str::to_owned),
            })
        };
        let state = Arc::new(test_state(vec![
            adapter(1, "sql", None),
            adapter(2, "alias", Some("org/base")),
        ]));
        let body = models(State(Arc::clone(&state))).await;
        let bytes = axum::body::to_bytes(body.into_body(), usize::MAX)
            .await
            .unwrap();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        let cards: Vec<(&str, &str, &Value, &Value)> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["id"].as_str().unwrap(),
                    c["root"].as_str().unwrap(),
                    &c["parent"],
                    &c["max_model_len"],
                )
            })
            .collect();
        assert_eq!(
            cards,
            vec![
                ("tiny", "org/tiny", &Value::Null, &json!(128)),
                ("alias", "org/tiny", &Value::Null, &json!(128)),
                ("sql", "/adapters/sql", &json!("tiny"), &Value::Null),
                ("alias", "/adapters/alias", &json!("org/base"), &Value::Null),
            ]
        );
        assert_eq!(v["data"][2]["owned_by"], "vllm");
        assert_eq!(v["data"][2]["permission"][0]["object"], "model_permission");

        let resolved = |m: Option<&str>| state.resolve_model(m).map(|a| a.map(|a| a.id));
        assert_eq!(resolved(None), Ok(None));
        assert_eq!(resolved(Some("tiny")), Ok(None));
        assert_eq!(resolved(Some("sql")), Ok(Some(1)));
        assert_eq!(
            resolved(Some("alias")),
            Ok(Some(2)),
            "an adapter's name wins"
        );
        assert_eq!(
            resolved(Some("nope")),
            Err(ApiError::model_not_found("nope"))
        );
    }

    /// An in-process server on 127.0.0.1:0 (its own runtime thread), for robustness tests.
    fn serve() -> (String, std::thread::JoinHandle<()>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let handle = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let state = Arc::new(test_state(Vec::new()));
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(format!("http://{}", listener.local_addr().unwrap()))
                    .unwrap();
                axum::serve(listener, router(state)).await.unwrap();
            });
        });
        (rx.recv().unwrap(), handle)
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (0u64..5000).prop_map(Value::from),
            "[a-z <|>]{0,12}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            let key = prop_oneof![
                Just("prompt"),
                Just("messages"),
                Just("model"),
                Just("max_tokens"),
                Just("stream"),
                Just("cache_salt"),
                Just("tokens"),
                Just("role"),
                Just("content"),
                Just("add_generation_prompt"),
                Just("continue_final_message"),
                Just("stream_options"),
            ];
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                proptest::collection::vec((key, inner), 0..5).prop_map(|kv| {
                    Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
                }),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
        /// Arbitrary JSON (and arbitrary bytes) on every request route: always an answer, 200 or
        /// a 4xx with vLLM's error body, never a 5xx or a dropped connection. (`/sim/stall` is
        /// left out: a valid body there pauses the engine, which is its job.)
        #[test]
        fn arbitrary_bodies_never_crash_the_server(body in json_value(), junk in proptest::collection::vec(any::<u8>(), 0..16)) {
            static SERVER: std::sync::OnceLock<String> = std::sync::OnceLock::new();
            let base = SERVER.get_or_init(|| serve().0);
            let client = raw_http::blocking_client();
            for path in ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"] {
                for payload in [body.to_string().into_bytes(), junk.clone()] {
                    let (status, text) = client(&format!("{base}{path}"), payload);
                    prop_assert!(status == 200 || (400..500).contains(&status), "{path}: {status} {text}");
                    if status != 200 {
                        let v: Value = serde_json::from_str(&text).unwrap();
                        prop_assert_eq!(v["error"]["code"].as_u64(), Some(u64::from(status)));
                    }
                }
            }
        }
    }

    mod raw_http {
        /// A tiny blocking HTTP/1.1 POST over std (no extra client in unit tests).
        pub fn blocking_client() -> impl Fn(&str, Vec<u8>) -> (u16, String) {
            |url: &str, body: Vec<u8>| {
                use std::io::{Read as _, Write as _};
                let rest = url.strip_prefix("http://").unwrap();
                let (host, path) = rest.split_once('/').unwrap();
                let mut s = std::net::TcpStream::connect(host).unwrap();
                // A server that never answers fails the test instead of hanging it.
                s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
                    .unwrap();
                let head = format!(
                    "POST /{path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                s.write_all(head.as_bytes()).unwrap();
                s.write_all(&body).unwrap();
                let mut out = String::new();
                s.read_to_string(&mut out).unwrap();
                let status: u16 = out[9..12].parse().unwrap();
                let text = out
                    .split_once("\r\n\r\n")
                    .map(|(_, b)| b.to_owned())
                    .unwrap_or_default();
                (status, text)
            }
        }
    }
}
