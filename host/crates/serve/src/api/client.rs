//! The control API's client, for the CLI (`tokwatt status`, `tokwatt policy`) and the load
//! tool: hyper over a Unix socket or loopback HTTP, with blocking calls (a small
//! current-thread runtime inside) and typed answers. Errors name the fix.

use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::body::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Method, Request, StatusCode, header};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;

use super::{ActionOutcome, NodeStatus, SwapRequest};
use tokwatt_plugin::sanitize_text;

/// How long a call may take, connection included (an action waits for a tick boundary).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest answer read (metrics of many GPUs stay far below it).
const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;
/// How much of the agent's error text is shown.
const MAX_ERROR_TEXT: usize = 2048;

/// Why a call failed. Each names the fix where there is one.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "is `tokwatt serve` running? the socket {} does not exist (pass --socket PATH if it serves elsewhere)",
        path.display()
    )]
    NoSocket { path: PathBuf },
    #[error("is `tokwatt serve` running? nothing listens on {target}")]
    NotListening { target: String },
    #[error(
        "permission denied on the socket {}: run as the user the agent runs as (the socket is mode 600)",
        path.display()
    )]
    SocketPermission { path: PathBuf },
    #[error("could not connect to {target}: {source}")]
    Connect {
        target: String,
        source: std::io::Error,
    },
    #[error("{}", unauthorized_message(token_file.as_deref()))]
    Unauthorized { token_file: Option<PathBuf> },
    /// The agent refused the request; `message` is its own words.
    #[error("{message} (HTTP {status})")]
    Refused { status: u16, message: String },
    #[error("the agent's answer could not be read: {0}")]
    Protocol(String),
    #[error("the agent did not answer within {0:?}")]
    TimedOut(Duration),
    #[error("--url {url}: {why}")]
    BadUrl { url: String, why: String },
    #[error("token file {}: {why}", path.display())]
    TokenFile { path: PathBuf, why: String },
    #[error("the token contains characters an HTTP header cannot carry: use a base64 or hex token")]
    BadToken,
    #[error("could not start the client's runtime: {0}")]
    Runtime(std::io::Error),
}

fn unauthorized_message(token_file: Option<&Path>) -> String {
    match token_file {
        Some(path) => format!(
            "401: the token in {} is not the agent's (use the file its --token-file names)",
            path.display()
        ),
        None => "401: the token is not the agent's".into(),
    }
}

impl ClientError {
    /// The HTTP status the agent answered with, when it answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Refused { status, .. } => Some(*status),
            ClientError::Unauthorized { .. } => Some(401),
            _ => None,
        }
    }
}

#[derive(Clone)]
enum Target {
    Unix {
        path: PathBuf,
    },
    Http {
        /// `host:port`.
        authority: String,
        authorization: header::HeaderValue,
        token_file: Option<PathBuf>,
    },
}

/// A connection to a running agent's control API. One connection per call.
pub struct ApiClient {
    target: Target,
    timeout: Duration,
    runtime: tokio::runtime::Runtime,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("ApiClient")
            .field("target", &self.describe_target())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl ApiClient {
    /// The agent listening on the Unix socket `path`.
    pub fn unix(path: impl Into<PathBuf>) -> Result<Self, ClientError> {
        Self::new(Target::Unix { path: path.into() })
    }

    /// The agent's loopback HTTP listener at `url` (`http://127.0.0.1:PORT`), with `token`.
    pub fn http(url: &str, token: &str) -> Result<Self, ClientError> {
        Self::http_inner(url, token, None)
    }

    /// As [`ApiClient::http`], the token read from `token_file` (named in a 401's message).
    pub fn http_with_token_file(url: &str, token_file: &Path) -> Result<Self, ClientError> {
        let token_error = |why: String| ClientError::TokenFile {
            path: token_file.to_owned(),
            why,
        };
        let text = std::fs::read_to_string(token_file)
            .map_err(|error| token_error(format!("cannot be read: {error}")))?;
        let token = text.trim();
        if token.is_empty() {
            return Err(token_error("is empty".into()));
        }
        Self::http_inner(url, token, Some(token_file.to_owned()))
    }

    fn http_inner(
        url: &str,
        token: &str,
        token_file: Option<PathBuf>,
    ) -> Result<Self, ClientError> {
        let authority = http_authority(url)?;
        let authorization = header::HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| ClientError::BadToken)?;
        Self::new(Target::Http {
            authority,
            authorization,
            token_file,
        })
    }

    fn new(target: Target) -> Result<Self, ClientError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(ClientError::Runtime)?;
        Ok(Self {
            target,
            timeout: DEFAULT_TIMEOUT,
            runtime,
        })
    }

    /// How long a call may take (default 30 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// `GET /v1/status`.
    pub fn status(&self) -> Result<NodeStatus, ClientError> {
        self.call_json(Method::GET, "/v1/status", None)
    }

    /// `GET /metrics`: the Prometheus text.
    pub fn metrics(&self) -> Result<String, ClientError> {
        let bytes = self.call(Method::GET, "/metrics", None)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| ClientError::Protocol("the metrics are not UTF-8 text".into()))
    }

    /// `POST /v1/policy/swap`.
    pub fn swap(&self, request: &SwapRequest) -> Result<ActionOutcome, ClientError> {
        let body = serde_json::to_vec(request).map_err(|error| {
            ClientError::Protocol(format!("the request could not be written: {error}"))
        })?;
        self.call_json(Method::POST, "/v1/policy/swap", Some(body))
    }

    /// `POST /v1/policy/rollback`.
    pub fn rollback(&self) -> Result<ActionOutcome, ClientError> {
        self.call_json(Method::POST, "/v1/policy/rollback", None)
    }

    /// `POST /v1/pause`.
    pub fn pause(&self) -> Result<ActionOutcome, ClientError> {
        self.call_json(Method::POST, "/v1/pause", None)
    }

    /// `POST /v1/resume`.
    pub fn resume(&self) -> Result<ActionOutcome, ClientError> {
        self.call_json(Method::POST, "/v1/resume", None)
    }

    /// `POST /v1/restore-defaults`.
    pub fn restore_defaults(&self) -> Result<ActionOutcome, ClientError> {
        self.call_json(Method::POST, "/v1/restore-defaults", None)
    }

    /// The socket path or HTTP address, in words.
    pub fn describe_target(&self) -> String {
        match &self.target {
            Target::Unix { path } => path.display().to_string(),
            Target::Http { authority, .. } => format!("http://{authority}"),
        }
    }

    fn call_json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, ClientError> {
        let bytes = self.call(method, path, body)?;
        serde_json::from_slice(&bytes).map_err(|error| {
            ClientError::Protocol(format!(
                "{path} answered JSON this client does not understand ({error}): are the agent and this tokwatt the same version?"
            ))
        })
    }

    fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Bytes, ClientError> {
        self.runtime.block_on(async {
            tokio::time::timeout(self.timeout, self.exchange(method, path, body))
                .await
                .map_err(|_| ClientError::TimedOut(self.timeout))?
        })
    }

    async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Bytes, ClientError> {
        let mut request = Request::builder().method(method).uri(path);
        let host = match &self.target {
            Target::Unix { .. } => "localhost",
            Target::Http { authority, .. } => authority.as_str(),
        };
        request = request.header(header::HOST, host);
        if let Target::Http { authorization, .. } = &self.target {
            request = request.header(header::AUTHORIZATION, authorization.clone());
        }
        if body.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let request = request
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|error| {
                ClientError::Protocol(format!("the request could not be built: {error}"))
            })?;

        let response = match &self.target {
            Target::Unix { path } => {
                let stream = tokio::net::UnixStream::connect(path)
                    .await
                    .map_err(|error| socket_connect_error(path, error))?;
                send(stream, request).await?
            }
            Target::Http { authority, .. } => {
                let stream = tokio::net::TcpStream::connect(authority.as_str())
                    .await
                    .map_err(|error| tcp_connect_error(authority, error))?;
                send(stream, request).await?
            }
        };
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|error| ClientError::Protocol(error.to_string()))?
            .to_bytes();
        if status.is_success() {
            return Ok(bytes);
        }
        if status == StatusCode::UNAUTHORIZED {
            return Err(ClientError::Unauthorized {
                token_file: match &self.target {
                    Target::Http { token_file, .. } => token_file.clone(),
                    Target::Unix { .. } => None,
                },
            });
        }
        Err(ClientError::Refused {
            status: status.as_u16(),
            message: error_message(&bytes),
        })
    }
}

async fn send<S>(
    stream: S,
    request: Request<Full<Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>, ClientError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let protocol = |error: hyper::Error| ClientError::Protocol(error.to_string());
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(protocol)?;
    // The connection runs beside the request on this client's runtime.
    tokio::spawn(connection);
    sender.send_request(request).await.map_err(protocol)
}

/// The agent's `{"error": "..."}`, or its text, bounded and escaped.
fn error_message(bytes: &[u8]) -> String {
    let text = serde_json::from_slice::<serde_json::Value>(bytes)
        .ok()
        .and_then(|value| {
            value
                .get("error")
                .and_then(|e| e.as_str())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| String::from_utf8_lossy(bytes).trim().to_owned());
    sanitize_text(&text, MAX_ERROR_TEXT)
}

fn socket_connect_error(path: &Path, error: std::io::Error) -> ClientError {
    match error.kind() {
        std::io::ErrorKind::NotFound => ClientError::NoSocket {
            path: path.to_owned(),
        },
        std::io::ErrorKind::ConnectionRefused => ClientError::NotListening {
            target: path.display().to_string(),
        },
        std::io::ErrorKind::PermissionDenied => ClientError::SocketPermission {
            path: path.to_owned(),
        },
        _ => ClientError::Connect {
            target: path.display().to_string(),
            source: error,
        },
    }
}

fn tcp_connect_error(authority: &str, error: std::io::Error) -> ClientError {
    match error.kind() {
        std::io::ErrorKind::ConnectionRefused => ClientError::NotListening {
            target: format!("http://{authority}"),
        },
        _ => ClientError::Connect {
            target: format!("http://{authority}"),
            source: error,
        },
    }
}

/// `host:port` of an `http://host[:port][/]` URL.
fn http_authority(url: &str) -> Result<String, ClientError> {
    let bad = |why: &str| ClientError::BadUrl {
        url: url.to_owned(),
        why: why.to_owned(),
    };
    let uri: hyper::Uri = url
        .parse()
        .map_err(|_| bad("not a URL; use http://127.0.0.1:PORT"))?;
    if uri.scheme_str() != Some("http") {
        return Err(bad(
            "only http:// is served (the agent's HTTP listener is loopback only); use http://127.0.0.1:PORT",
        ));
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(bad(
            "give the agent's address only, without a path: http://127.0.0.1:PORT",
        ));
    }
    let authority = uri
        .authority()
        .ok_or_else(|| bad("no host; use http://127.0.0.1:PORT"))?;
    if authority.as_str().contains('@') {
        return Err(bad(
            "credentials in the URL are not used: pass --token-file",
        ));
    }
    let port = authority.port_u16().unwrap_or(80);
    Ok(format!("{}:{port}", authority.host()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_become_host_and_port_or_a_fix() {
        assert_eq!(
            http_authority("http://127.0.0.1:8321").expect("ok"),
            "127.0.0.1:8321"
        );
        assert_eq!(
            http_authority("http://127.0.0.1:8321/").expect("ok"),
            "127.0.0.1:8321"
        );
        assert_eq!(http_authority("http://[::1]:9").expect("ok"), "[::1]:9");
        assert_eq!(
            http_authority("http://localhost").expect("ok"),
            "localhost:80"
        );
        for bad in [
            "https://127.0.0.1:1",
            "127.0.0.1:1",
            "http://h:1/v1/status",
            "http://u:p@h:1",
        ] {
            let error = http_authority(bad).expect_err(bad).to_string();
            assert!(error.contains("--url") && error.contains(bad), "{error}");
        }
    }

    #[test]
    fn the_agents_error_text_is_shown_escaped() {
        assert_eq!(
            error_message(br#"{"error": "no previous policy"}"#),
            "no previous policy"
        );
        assert_eq!(error_message(b"plain\x1b[2Jtext"), "plain\\u{1b}[2Jtext");
    }

    #[test]
    fn a_missing_socket_names_the_fix() {
        let client = ApiClient::unix("/nonexistent/tokwatt.sock").expect("client");
        let error = client.status().expect_err("no socket").to_string();
        assert!(error.contains("is `tokwatt serve` running?"), "{error}");
        assert!(error.contains("/nonexistent/tokwatt.sock"), "{error}");
        assert!(!format!("{client:?}").contains("Bearer"));
    }
}
