//! What the console asks of the agent beyond watching: the roster, a
//! what-if (Place, a dry run any viewer may make) and, only when the
//! operator turned them on, actions (Start, Stop, Sleep, and a wake,
//! which is a Start of a sleeping instance).
//!
//! Actions are off unless the router was given a token
//! (`--console-token-file`); each then needs `Authorization: Bearer
//! TOKEN`, which a page from elsewhere cannot send (no cookie is
//! involved, so no cross-site request can borrow it). An action reaches
//! the agent as the router's own call: the agent's roles decide (the
//! router's identity needs `operator`) and its audit trail records it.
//!
//! - `GET /ui/workloads`: the workloads' names and whether actions are on.
//! - `GET /ui/place?workload=NAME`: Place's answer.
//! - `POST /ui/act`: `{"action": "start"|"stop"|"sleep"|"wake",
//!   "workload": ..., "id": ...}`. A start without an id starts the
//!   instance the router would start on demand, whose id is the
//!   workload's name (an ended one of that id is replaced, not left
//!   beside it).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, StatusCode, header};
use resident_api::pb;
use serde::Deserialize;
use serde_json::{Value, json};
use tonic_types::StatusExt as _;

use super::view;
use crate::App;

/// The roster and the mode.
pub async fn workloads(State(app): State<Arc<App>>) -> Response {
    match app.models.agent().workloads().await {
        Ok(w) => Json(json!({
            "workloads": w.iter().map(|w| w.name.as_str()).collect::<Vec<_>>(),
            "actions": app.options.console_token.is_some(),
        }))
        .into_response(),
        Err(s) => agent_error(&s),
    }
}

#[derive(Debug, Deserialize)]
pub struct PlaceQuery {
    workload: String,
}

/// Place's answer for one workload, as the page draws it.
pub async fn place(State(app): State<Arc<App>>, Query(q): Query<PlaceQuery>) -> Response {
    match app.models.agent().place(&q.workload).await {
        Ok(p) => Json(placement(&q.workload, &p)).into_response(),
        Err(s) => agent_error(&s),
    }
}

/// A Placement as plain data: admitted, whom it would put to sleep or
/// evict (with what each holds), what it waits for, or every reason not.
pub fn placement(workload: &str, p: &pb::Placement) -> Value {
    json!({
        "workload": workload,
        "admitted": p.admitted,
        "sleep": p.sleep,
        "evict": p.victims.iter().map(|v| json!({
            "id": v.instance_id, "workload": v.workload, "bytes": v.bytes,
        })).collect::<Vec<_>>(),
        "wait_for": p.wait_for,
        "free_after": p.free_after_bytes,
        "refusals": p.refusals.iter().map(view::refusal).collect::<Vec<_>>(),
    })
}

/// One action from the page.
#[derive(Debug, Deserialize)]
pub struct Action {
    action: String,
    #[serde(default)]
    workload: String,
    #[serde(default)]
    id: String,
}

/// Carries out an action when actions are on and the token is right.
pub async fn act(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let Some(token) = app.options.console_token.as_deref() else {
        return refuse(
            StatusCode::FORBIDDEN,
            "the console is read-only: actions are off (start residentd-router with --console-token-file to turn them on)",
        );
    };
    if !bearer_is(&headers, token) {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "actions need the console's token (Authorization: Bearer ...), and this one is missing or wrong",
        );
    }
    let a: Action = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, &format!("the action's body: {e}")),
    };
    let agent = app.models.agent();
    let need = |field: &str, value: &str| {
        value.is_empty().then(|| {
            refuse(
                StatusCode::BAD_REQUEST,
                &format!("the action '{}' needs its field '{field}'", a.action),
            )
        })
    };
    let done = match a.action.as_str() {
        "start" | "wake" => {
            if let Some(r) = need("workload", &a.workload) {
                return r;
            }
            if a.action == "wake"
                && let Some(r) = need("id", &a.id)
            {
                return r;
            }
            // The id of a start on demand, so the console and the
            // router's requests start (and find) the same instance.
            let id = if a.id.is_empty() { &a.workload } else { &a.id };
            agent
                .start_admitted(&a.workload, id)
                .await
                .map(|r| started(&a.action, &r))
        }
        "stop" | "sleep" => {
            if let Some(r) = need("id", &a.id) {
                return r;
            }
            let call = if a.action == "stop" {
                agent.stop(&a.id).await
            } else {
                agent.sleep(&a.id).await
            };
            call.map(|i| json!({"ok": true, "message": format!("{} {}: {}", a.action, i.instance_id, view::state_name(i.state))}))
        }
        other => {
            return refuse(
                StatusCode::BAD_REQUEST,
                &format!("'{other}' is not an action: start, stop, sleep or wake"),
            );
        }
    };
    tracing::info!(action = %a.action, workload = %a.workload, id = %a.id, ok = done.is_ok(), "console action");
    match done {
        Ok(v) => Json(v).into_response(),
        Err(s) => agent_error(&s),
    }
}

/// What a start or wake did.
fn started(action: &str, r: &pb::StartResponse) -> Value {
    let (id, state) = r.instance.as_ref().map_or(("", ""), |i| {
        (i.instance_id.as_str(), view::state_name(i.state))
    });
    let mut message = format!("{action} {id}: {state}");
    if !r.slept.is_empty() {
        message.push_str(&format!("; put to sleep: {}", r.slept.join(", ")));
    }
    if !r.evicted.is_empty() {
        message.push_str(&format!("; evicted: {}", r.evicted.join(", ")));
    }
    json!({"ok": true, "message": message, "id": id})
}

/// Whether the request carries `Authorization: Bearer token`, compared
/// in time that does not depend on where the first difference is.
fn bearer_is(headers: &HeaderMap, token: &str) -> bool {
    let Some(given) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    let (a, b) = (given.trim().as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

fn refuse(code: StatusCode, message: &str) -> Response {
    (code, Json(json!({"ok": false, "message": message}))).into_response()
}

/// The agent's answer to a call that did not go through, with its words
/// (a refusal's holders reach the page through the Watch event too).
fn agent_error(s: &tonic::Status) -> Response {
    let code = match s.code() {
        tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => StatusCode::FORBIDDEN,
        tonic::Code::NotFound => StatusCode::NOT_FOUND,
        tonic::Code::ResourceExhausted
        | tonic::Code::FailedPrecondition
        | tonic::Code::AlreadyExists
        | tonic::Code::InvalidArgument => StatusCode::CONFLICT,
        _ => StatusCode::BAD_GATEWAY,
    };
    let refusal = (s.code() == tonic::Code::ResourceExhausted).then(|| {
        let detail = s.get_error_details();
        detail.error_info().map(|i| i.reason.clone())
    });
    (
        code,
        Json(json!({
            "ok": false,
            "message": format!("the agent answered {:?}: {}", s.code(), s.message()),
            "reason": refusal.flatten(),
        })),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_bearer_token_passes() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, v.parse().expect("value"));
            h
        };
        assert!(bearer_is(&with("Bearer s3cret"), "s3cret"));
        assert!(!bearer_is(&with("Bearer s3cre"), "s3cret"));
        assert!(!bearer_is(&with("Bearer s3cretx"), "s3cret"));
        assert!(!bearer_is(&with("Basic s3cret"), "s3cret"));
        assert!(!bearer_is(&HeaderMap::new(), "s3cret"));
    }

    #[test]
    fn a_placement_says_whom_it_would_move_or_why_not() {
        let p = pb::Placement {
            admitted: true,
            sleep: vec!["a".into()],
            victims: vec![pb::Victim {
                instance_id: "b".into(),
                workload: "w".into(),
                bytes: 5,
                priority: 0,
            }],
            ..Default::default()
        };
        let v = placement("big", &p);
        assert_eq!(v["sleep"], json!(["a"]));
        assert_eq!(
            v["evict"],
            json!([{"id": "b", "workload": "w", "bytes": 5}])
        );
        let refused = pb::Placement {
            refusals: vec![pb::Refusal {
                message: "unplaceable: 'big' needs 8.0 GB".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let v = placement("big", &refused);
        assert_eq!(v["admitted"], false);
        assert_eq!(
            v["refusals"][0]["message"],
            "unplaceable: 'big' needs 8.0 GB"
        );
    }
}
