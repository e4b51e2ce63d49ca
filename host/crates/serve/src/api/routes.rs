//! The control API's routes: every request is checked here (method, content type, size,
//! JSON keys and types, absolute paths) before anything reaches [`Control`], so a bad
//! request changes nothing.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use http_body_util::{BodyExt, Limited};
use serde::Serialize;

use super::auth::BearerToken;
use super::{Control, ControlError, SwapRequest};

/// The largest request body accepted.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// How much of an oversized body is read and thrown away before the 413 answer, so the
/// client reads the answer instead of a connection reset (bounded: the rest is dropped).
const OVERSIZED_DRAIN_BYTES: usize = 1024 * 1024;

/// Every endpoint, as the 404 answer lists them.
pub const ENDPOINTS: &[(&str, &str)] = &[
    ("GET", "/v1/status"),
    ("POST", "/v1/policy/swap"),
    ("POST", "/v1/policy/rollback"),
    ("POST", "/v1/pause"),
    ("POST", "/v1/resume"),
    ("POST", "/v1/restore-defaults"),
    ("GET", "/metrics"),
];

type Shared = Arc<dyn Control>;

/// A request that changed nothing, answered as JSON `{"error": "..."}`.
#[derive(Debug)]
pub(crate) struct Refusal {
    status: StatusCode,
    message: String,
}

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            axum::Json(ErrorBody {
                error: &self.message,
            }),
        )
            .into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<ControlError> for Refusal {
    fn from(error: ControlError) -> Self {
        let status = match &error {
            ControlError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ControlError::Conflict(_) => StatusCode::CONFLICT,
            ControlError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        Self::new(status, error.to_string())
    }
}

/// The control endpoints (the socket's and, behind [`with_token`], the HTTP listener's).
pub(crate) fn control_router(control: Shared) -> Router {
    Router::new()
        .route("/v1/status", only("GET", get(status)))
        .route("/v1/policy/swap", only("POST", post(swap)))
        .route("/v1/policy/rollback", only("POST", post(rollback)))
        .route("/v1/pause", only("POST", post(pause)))
        .route("/v1/resume", only("POST", post(resume)))
        .route("/v1/restore-defaults", only("POST", post(restore_defaults)))
        .route("/metrics", only("GET", get(metrics)))
        .fallback(not_found)
        .with_state(control)
}

/// The read-only metrics listener: `/metrics` and `/healthz`, no token.
pub(crate) fn metrics_router(control: Shared) -> Router {
    Router::new()
        .route("/metrics", only("GET", get(metrics)))
        .route("/healthz", only("GET", get(healthz)))
        .fallback(|| async {
            Refusal::new(
                StatusCode::NOT_FOUND,
                "no such endpoint; this listener serves GET /metrics and GET /healthz",
            )
        })
        .with_state(control)
}

/// `router` with every request, unknown paths included, refused with 401 unless it
/// carries the token.
pub(crate) fn with_token(router: Router, token: BearerToken) -> Router {
    router.layer(middleware::from_fn_with_state(token, require_token))
}

async fn require_token(State(token): State<BearerToken>, request: Request, next: Next) -> Response {
    let offered = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    if token.accepts(offered) {
        next.run(request).await
    } else {
        Refusal::new(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token: send `Authorization: Bearer TOKEN` with the token in the agent's --token-file",
        )
        .into_response()
    }
}

/// `route` answering 405 with the allowed method for any other method.
fn only<S: Clone + Send + Sync + 'static>(
    allowed: &'static str,
    route: MethodRouter<S>,
) -> MethodRouter<S> {
    route.fallback(move |request: Request| async move {
        let mut response = Refusal::new(
            StatusCode::METHOD_NOT_ALLOWED,
            format!(
                "{} is not allowed on {}: use {allowed}",
                request.method(),
                request.uri().path()
            ),
        )
        .into_response();
        response
            .headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static(allowed));
        response
    })
}

async fn not_found(request: Request) -> Refusal {
    let endpoints: Vec<String> = ENDPOINTS
        .iter()
        .map(|(method, path)| format!("{method} {path}"))
        .collect();
    Refusal::new(
        StatusCode::NOT_FOUND,
        format!(
            "no endpoint {}; the endpoints are: {}",
            request.uri().path(),
            endpoints.join(", ")
        ),
    )
}

async fn status(State(control): State<Shared>) -> Response {
    answer(move || Ok(control.status())).await
}

async fn metrics(State(control): State<Shared>) -> Response {
    match tokio::task::spawn_blocking(move || control.metrics()).await {
        Ok(text) => {
            let content_type = metrics_content_type(&text);
            ([(header::CONTENT_TYPE, content_type)], text).into_response()
        }
        Err(_) => agent_failed(),
    }
}

/// A read-only metrics listener for a process that is not a node agent (the fleet's
/// coordinator): the same endpoints, served from `source`.
pub(crate) fn source_metrics_router(source: Arc<dyn super::MetricsSource>) -> Router {
    Router::new()
        .route("/metrics", only("GET", get(source_metrics)))
        .route("/healthz", only("GET", get(healthz)))
        .fallback(|| async {
            Refusal::new(
                StatusCode::NOT_FOUND,
                "no such endpoint; this listener serves GET /metrics and GET /healthz",
            )
        })
        .with_state(source)
}

async fn source_metrics(State(source): State<Arc<dyn super::MetricsSource>>) -> Response {
    match tokio::task::spawn_blocking(move || source.metrics()).await {
        Ok(text) => ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response(),
        Err(_) => agent_failed(),
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn swap(State(control): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let request = match read_json_body(&headers, body).await.and_then(|body| {
        let value = body.ok_or_else(|| {
            Refusal::bad_request(
                "the swap request has no body: send {\"spec\": \"/absolute/path/policy.toml\"}",
            )
        })?;
        swap_request(value)
    }) {
        Ok(request) => request,
        Err(refusal) => return refusal.into_response(),
    };
    answer(move || control.swap(&request)).await
}

async fn rollback(State(control): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    action(headers, body, move || control.rollback()).await
}

async fn pause(State(control): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    action(headers, body, move || control.pause()).await
}

async fn resume(State(control): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    action(headers, body, move || control.resume()).await
}

async fn restore_defaults(
    State(control): State<Shared>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    action(headers, body, move || control.restore_defaults()).await
}

/// An action without parameters: its body, if any, must be the empty JSON object.
async fn action<T: Serialize + Send + 'static>(
    headers: HeaderMap,
    body: Body,
    call: impl FnOnce() -> Result<T, ControlError> + Send + 'static,
) -> Response {
    match read_json_body(&headers, body).await {
        Ok(None) => {}
        Ok(Some(serde_json::Value::Object(keys))) if keys.is_empty() => {}
        Ok(Some(_)) => {
            return Refusal::bad_request("this action takes no parameters: send no body, or {}")
                .into_response();
        }
        Err(refusal) => return refusal.into_response(),
    }
    answer(call).await
}

/// Runs a `Control` call on the blocking pool (it waits for a tick boundary), so other
/// requests, status among them, never wait behind it.
async fn answer<T: Serialize + Send + 'static>(
    call: impl FnOnce() -> Result<T, ControlError> + Send + 'static,
) -> Response {
    match tokio::task::spawn_blocking(call).await {
        Ok(Ok(value)) => axum::Json(value).into_response(),
        Ok(Err(error)) => Refusal::from(error).into_response(),
        Err(_) => agent_failed(),
    }
}

fn agent_failed() -> Response {
    Refusal::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the agent failed while answering (see its log)",
    )
    .into_response()
}

/// The body as JSON, or `None` when it is empty. Checks, in order: the content type
/// (415), the size (413), the JSON syntax (400).
async fn read_json_body(
    headers: &HeaderMap,
    body: Body,
) -> Result<Option<serde_json::Value>, Refusal> {
    let declared_length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    let content_type = headers.get(header::CONTENT_TYPE);
    if declared_length == Some(0) && content_type.is_none() {
        return Ok(None);
    }
    let bytes = read_limited(body).await?;
    if bytes.is_empty() && content_type.is_none() {
        return Ok(None);
    }
    if !content_type.is_some_and(is_json) {
        return Err(Refusal::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "the body must be JSON: send `Content-Type: application/json` (got {})",
                content_type
                    .map(|value| format!("{:?}", String::from_utf8_lossy(value.as_bytes())))
                    .unwrap_or_else(|| "no Content-Type".into())
            ),
        ));
    }
    if bytes.is_empty() {
        return Ok(None);
    }
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|error| Refusal::bad_request(format!("the body is not valid JSON: {error}")))
}

async fn read_limited(body: Body) -> Result<Bytes, Refusal> {
    let too_large = || {
        Refusal::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body is larger than {MAX_BODY_BYTES} bytes, the most a request may send"),
        )
    };
    let mut body = body;
    let mut collected = Vec::new();
    loop {
        match body.frame().await {
            None => return Ok(Bytes::from(collected)),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    if collected.len() + data.len() > MAX_BODY_BYTES {
                        drain(Limited::new(body, OVERSIZED_DRAIN_BYTES)).await;
                        return Err(too_large());
                    }
                    collected.extend_from_slice(&data);
                }
            }
            Some(Err(error)) => {
                return Err(Refusal::bad_request(format!(
                    "the body could not be read: {error}"
                )));
            }
        }
    }
}

/// Reads and drops what is left of a body, up to the limit (or a read error).
async fn drain(body: Limited<Body>) {
    let mut body = body;
    // The limit's error or a read error ends it either way.
    while let Some(Ok(_)) = body.frame().await {}
}

fn is_json(value: &HeaderValue) -> bool {
    value
        .to_str()
        .ok()
        .and_then(|text| text.split(';').next())
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

/// A [`SwapRequest`] from JSON, each key and type checked by name, both paths absolute
/// (the agent's working folder is not the operator's).
fn swap_request(value: serde_json::Value) -> Result<SwapRequest, Refusal> {
    const SHAPE: &str = "send {\"spec\": \"/absolute/path/policy.toml\", \"plugin\": \"/absolute/path/policy.wasm\" (optional), \"fresh\": true (optional: without the running policy's state)}";
    let serde_json::Value::Object(keys) = value else {
        return Err(Refusal::bad_request(format!(
            "the swap request must be a JSON object: {SHAPE}"
        )));
    };
    for (key, value) in &keys {
        match key.as_str() {
            "spec" if !value.is_string() => {
                return Err(Refusal::bad_request(format!(
                    "key `spec` must be a string (an absolute path), not {}: {SHAPE}",
                    json_kind(value)
                )));
            }
            "plugin" if !(value.is_string() || value.is_null()) => {
                return Err(Refusal::bad_request(format!(
                    "key `plugin` must be a string (an absolute path) or null, not {}: {SHAPE}",
                    json_kind(value)
                )));
            }
            "fresh" if !value.is_boolean() => {
                return Err(Refusal::bad_request(format!(
                    "key `fresh` must be true or false, not {}: {SHAPE}",
                    json_kind(value)
                )));
            }
            "spec" | "plugin" | "fresh" => {}
            unknown => {
                return Err(Refusal::bad_request(format!(
                    "unknown key `{}` in the swap request (the keys are `spec`, `plugin` and `fresh`): {SHAPE}",
                    tokwatt_plugin::sanitize_text(unknown, 128)
                )));
            }
        }
    }
    let request: SwapRequest = serde_json::from_value(serde_json::Value::Object(keys))
        .map_err(|error| Refusal::bad_request(format!("{error}: {SHAPE}")))?;
    for (key, path) in std::iter::once(("spec", &request.spec))
        .chain(request.plugin.iter().map(|plugin| ("plugin", plugin)))
    {
        if !path.is_absolute() {
            return Err(Refusal::bad_request(format!(
                "`{key}` must be an absolute path on the agent's machine, not {:?} (`tokwatt policy swap` makes it absolute for you)",
                path
            )));
        }
    }
    Ok(request)
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The agent's metrics are Prometheus' classic text format (counter families named with
/// `_total`, as promtool and every Prometheus read it), whatever their last line: the
/// `# EOF` that `prometheus-client` ends with is a comment in that format.
pub(crate) fn metrics_content_type(_text: &str) -> &'static str {
    crate::metrics::CONTENT_TYPE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_errors_map_to_their_statuses() {
        let cases = [
            (
                ControlError::BadRequest("b".into()),
                StatusCode::BAD_REQUEST,
            ),
            (ControlError::Conflict("c".into()), StatusCode::CONFLICT),
            (
                ControlError::Unavailable("u".into()),
                StatusCode::SERVICE_UNAVAILABLE,
            ),
        ];
        for (error, status) in cases {
            let message = error.to_string();
            let refusal = Refusal::from(error);
            assert_eq!(refusal.status, status);
            assert_eq!(refusal.message, message);
        }
    }

    #[test]
    fn swap_requests_name_the_bad_key_and_want_absolute_paths() {
        let refused = |value: serde_json::Value| swap_request(value).expect_err("refused").message;
        assert!(refused(serde_json::json!({"spec": "/a.toml", "plugn": "/b"})).contains("`plugn`"));
        assert!(refused(serde_json::json!({"spec": 3})).contains("key `spec` must be a string"));
        assert!(refused(serde_json::json!({"spec": "/a", "plugin": []})).contains("`plugin`"));
        assert!(refused(serde_json::json!({})).contains("missing field `spec`"));
        assert!(refused(serde_json::json!(["/a"])).contains("JSON object"));
        assert!(refused(serde_json::json!({"spec": "a.toml"})).contains("absolute path"));
        assert!(
            refused(serde_json::json!({"spec": "/a.toml", "plugin": "p.wasm"}))
                .contains("`plugin` must be an absolute path")
        );
        let request =
            swap_request(serde_json::json!({"spec": "/a.toml", "plugin": null})).expect("valid");
        assert_eq!(request.spec, std::path::Path::new("/a.toml"));
        assert_eq!(request.plugin, None);
        assert!(!request.fresh, "a swap carries the state unless asked");
        assert!(refused(serde_json::json!({"spec": "/a", "fresh": "yes"})).contains("`fresh`"));
        let fresh =
            swap_request(serde_json::json!({"spec": "/a.toml", "fresh": true})).expect("valid");
        assert!(fresh.fresh);
    }

    #[test]
    fn json_content_types_are_recognised() {
        assert!(is_json(&HeaderValue::from_static("application/json")));
        assert!(is_json(&HeaderValue::from_static(
            "Application/JSON; charset=utf-8"
        )));
        assert!(!is_json(&HeaderValue::from_static("text/plain")));
        assert!(!is_json(&HeaderValue::from_static("application/jsonx")));
    }

    #[test]
    fn metrics_are_served_as_the_classic_text_format_even_with_an_eof_line() {
        assert_eq!(
            metrics_content_type("a_total 1\n# EOF\n"),
            crate::metrics::CONTENT_TYPE
        );
        assert_eq!(
            metrics_content_type("a_total 1\n"),
            crate::metrics::CONTENT_TYPE
        );
    }
}
