//! Errors as OpenAI clients expect them: `{"error": {"message", "type",
//! "code"}}` with the HTTP status the type implies (docs/router.md lists
//! them). A caller's input is quoted only as a short excerpt.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};

/// The most characters of caller input an error quotes.
const EXCERPT: usize = 64;

/// An answer that is not the model's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The OpenAI error `type`.
    pub kind: &'static str,
    /// The OpenAI error `code` (for refusals, the agent's reason).
    pub code: String,
    /// For people.
    pub message: String,
    /// Seconds to wait before a retry (`Retry-After`).
    pub retry_after: Option<u64>,
}

impl RouterError {
    fn new(status: StatusCode, kind: &'static str, code: &str, message: String) -> Self {
        Self {
            status,
            kind,
            code: code.to_string(),
            message,
            retry_after: None,
        }
    }

    /// 400: the request itself is wrong.
    pub fn invalid(code: &str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message.into(),
        )
    }

    /// 404: no workload or alias by this name.
    pub fn unknown_model(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "model_not_found",
            "model_not_found",
            format!(
                "the model {} does not exist: GET /v1/models lists the models this node serves",
                excerpt(model)
            ),
        )
    }

    /// 503: the agent refused to place the model, and waiting will not help.
    pub fn unplaceable(reason: &str, message: &str) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unplaceable",
            reason,
            message.to_string(),
        )
    }

    /// 503 with Retry-After: the model waited its turn for longer than the
    /// queue timeout.
    pub fn queue_timeout(model: &str, waited_s: u64, why: &str) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "queue_timeout",
            "queue_timeout",
            format!(
                "model '{model}' waited {waited_s} s (--queue-timeout) in the queue of starts and was not started: {why}"
            ),
        );
        e.retry_after = Some(waited_s.clamp(1, 30));
        e
    }

    /// 429: the model's concurrency limit is reached.
    pub fn too_many(model: &str, limit: u32) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_requests",
            "concurrency_limit",
            format!("model '{model}' already answers its concurrency_limit of {limit} requests"),
        );
        e.retry_after = Some(1);
        e
    }

    /// 413: the body is larger than the router takes.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            "request_too_large",
            format!("the request body is larger than {limit} bytes (--max-body)"),
        )
    }

    /// 408: the client sent its body too slowly.
    pub fn slow_body(limit_s: u64) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_timeout",
            format!("the request body did not arrive within {limit_s} s (--body-timeout)"),
        )
    }

    /// 502: the model's server could not be reached or failed to start.
    pub fn upstream(model: &str, message: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "upstream_error",
            format!("model '{model}': {message}"),
        )
    }

    /// 503: the agent could not be asked.
    pub fn agent(message: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "agent_unavailable",
            "agent_unavailable",
            format!("the residentd agent did not answer: {message}"),
        )
    }

    /// 403: the agent refused the router's identity the call (its roles,
    /// `[node.access]`), in the agent's words.
    pub fn denied(message: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "permission_denied",
            "permission_denied",
            format!(
                "the residentd agent refused the router's call: {message} (the router's identity needs the operator role: docs/router.md, Roles)"
            ),
        )
    }

    /// What a failed call to the agent means: a role refusal is 403 with
    /// the agent's words; anything else, that the agent did not answer.
    pub fn from_status(status: &tonic::Status) -> Self {
        match status.code() {
            tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => {
                Self::denied(status.message())
            }
            _ => Self::agent(status.message()),
        }
    }

    /// 503 with Retry-After: a bound of the router's own is reached
    /// (`code` says which, `message` which flag sets it).
    pub fn busy(code: &str, message: String) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", code, message);
        e.retry_after = Some(1);
        e
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for RouterError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body().to_string(),
        )
            .into_response();
        if let Some(s) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

/// A short, quoted prefix of `s` and its length when cut.
pub fn excerpt(s: &str) -> String {
    // Escaped (`\n`, `\u{1b}`): a client's string can neither start a
    // log line of its own nor send escape codes to a terminal.
    let count = s.chars().count();
    if count <= EXCERPT {
        return format!("'{}'", s.escape_debug());
    }
    let head: String = s.chars().take(EXCERPT).collect();
    format!("'{}...' ({count} characters)", head.escape_debug())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_excerpt_escapes_what_could_forge_a_log_line() {
        for name in [
            "a\nINFO forged line",
            "\u{1b}[31mred",
            &format!("{}\r\n", "x".repeat(100)),
        ] {
            let e = excerpt(name);
            assert!(!e.chars().any(char::is_control), "{e:?}");
        }
        assert_eq!(excerpt("a\nb"), "'a\\nb'");
    }

    #[test]
    fn errors_have_the_openai_shape_and_quote_little() {
        let e = RouterError::unknown_model(&"x".repeat(10_000));
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        let body = e.body();
        assert_eq!(body["error"]["type"], "model_not_found");
        assert_eq!(body["error"]["code"], "model_not_found");
        let message = body["error"]["message"].as_str().expect("message");
        assert!(message.len() < 200, "{message}");
        assert!(message.contains("10000 characters"), "{message}");
        let r = RouterError::queue_timeout("a", 60, "held").into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::RETRY_AFTER], "30");
    }
}
