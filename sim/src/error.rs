//! vLLM's error responses: `{"error": {"message", "type", "param", "code"}}` with the HTTP
//! status in `code` (`ErrorResponse`/`ErrorInfo` in vLLM's OpenAI protocol).

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to the client; never a crash.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
        }
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_owned());
        self
    }

    /// vLLM's answer to an unknown `model`.
    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            param: Some("model".into()),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            param: None,
        }
    }

    /// The `type` vLLM puts beside each status.
    pub fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            StatusCode::NOT_IMPLEMENTED => "NotImplementedError",
            _ => "InternalServerError",
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }
}

impl ApiError {
    /// The error as vLLM's `/v1/messages` answers it: `{"type": "error", "error": {"type",
    /// "message"}}`.
    pub fn into_anthropic_response(self) -> Response {
        let kind = match self.status {
            StatusCode::BAD_REQUEST => "invalid_request_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            _ => "api_error",
        };
        let body = json!({"type": "error", "error": {"type": kind, "message": self.message}});
        (self.status, Json(body)).into_response()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_body_has_vllms_shape() {
        let e = ApiError::model_not_found("nope");
        assert_eq!(
            e.body(),
            json!({"error": {"message": "The model `nope` does not exist.",
                             "type": "NotFoundError", "param": "model", "code": 404}})
        );
        let e = ApiError::bad_request("x");
        assert_eq!(e.body()["error"]["type"], "BadRequestError");
        assert_eq!(e.body()["error"]["code"], 400);
        assert!(e.body()["error"]["param"].is_null());
    }
}
