//! The control API's server: axum on a current-thread tokio runtime, on a thread of its
//! own, listening on a Unix socket, on optional loopback HTTP (bearer token) and on an
//! optional read-only metrics address. `Control` calls run on tokio's blocking pool, so a
//! status request never waits behind a swap and the control loop never waits on the API.

use std::fs;
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use axum::Router;
use tokio::sync::watch;

use super::Control;
use super::accept::{self, ConnectionLimits};
use super::auth::BearerToken;
use super::routes;

/// How long requests in flight may take to finish once the server is asked to stop (a
/// swap waits for a tick boundary, a few seconds at most).
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Where the API listens. At least one of `socket`, `http` and `metrics` is needed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApiConfig {
    /// The Unix socket (no token: the file's mode, 0600, is the access control).
    pub socket: Option<PathBuf>,
    /// Loopback HTTP (127.0.0.0/8 or ::1), every request needing the token in `token_file`.
    pub http: Option<SocketAddr>,
    /// The bearer token for `http`: a file readable by its owner alone.
    pub token_file: Option<PathBuf>,
    /// Read-only `GET /metrics` and `GET /healthz`, any address, no token.
    pub metrics: Option<SocketAddr>,
}

/// Why the API could not start. Each names the problem and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(
        "the control API has nothing to listen on: give a socket, an HTTP address or a metrics address"
    )]
    NothingToServe,
    #[error(
        "the control API's HTTP address {addr} is not a loopback address: use 127.0.0.1:PORT or [::1]:PORT (remote operators reach the agent over SSH or through the read-only metrics address)"
    )]
    NotLoopback { addr: SocketAddr },
    #[error(
        "the control API's HTTP address {addr} needs a token file (--token-file FILE, mode 600)"
    )]
    NoTokenFile { addr: SocketAddr },
    #[error("a token file was given but no HTTP address to use it on")]
    TokenWithoutHttp,
    #[error("token file {path} {why}")]
    TokenFile { path: PathBuf, why: String },
    #[error("could not create the socket's folder {path}: {source}")]
    SocketFolder { path: PathBuf, source: io::Error },
    #[error("{path} exists and is not a socket: remove it, or pass another --socket")]
    NotASocket { path: PathBuf },
    #[error("another tokwatt serves on {path}: stop it first, or pass another --socket")]
    AlreadyServing { path: PathBuf },
    #[error(
        "could not tell whether anything serves on {path} ({source}); remove it if nothing does"
    )]
    SocketProbe { path: PathBuf, source: io::Error },
    #[error("could not listen on {what} {target}: {source}")]
    Bind {
        what: &'static str,
        target: String,
        source: io::Error,
    },
    #[error("could not start the control API's runtime: {0}")]
    Runtime(io::Error),
}

/// The running API. Stops (and removes its socket file) on [`ApiServer::shutdown`] or drop.
#[derive(Debug)]
pub struct ApiServer {
    stop: Option<watch::Sender<bool>>,
    thread: Option<JoinHandle<()>>,
    socket: Option<OwnedSocket>,
    http_addr: Option<SocketAddr>,
    metrics_addr: Option<SocketAddr>,
}

/// The socket file this server made, recognised by its inode so that shutdown never
/// removes a socket another process put there since.
#[derive(Debug)]
struct OwnedSocket {
    path: PathBuf,
    device: u64,
    inode: u64,
}

impl ApiServer {
    /// Binds every listener (so that a bad address, a live socket or a bad token file is
    /// reported here, before the agent changes anything) and serves on a thread of its own.
    pub fn start(config: ApiConfig, control: Arc<dyn Control>) -> Result<ApiServer, ApiError> {
        if config.socket.is_none() && config.http.is_none() && config.metrics.is_none() {
            return Err(ApiError::NothingToServe);
        }
        let http = match config.http {
            Some(addr) => Some(http_listener(addr, config.token_file.as_deref())?),
            None if config.token_file.is_some() => return Err(ApiError::TokenWithoutHttp),
            None => None,
        };
        let metrics = config
            .metrics
            .map(|addr| bind_tcp("the metrics address", addr))
            .transpose()?;
        // The socket last: nothing else can fail after its file is made.
        let socket = config.socket.as_deref().map(bind_socket).transpose()?;

        let mut server = ApiServer {
            stop: None,
            thread: None,
            socket: None,
            http_addr: None,
            metrics_addr: None,
        };
        let (socket_listener, owned) = match socket {
            Some((listener, owned)) => (Some(listener), Some(owned)),
            None => (None, None),
        };
        // From here on, dropping `server` removes the socket file.
        server.socket = owned;
        server.http_addr = http
            .as_ref()
            .map(|(listener, _)| listener.local_addr())
            .transpose()
            .map_err(|source| bind_error("the HTTP address", config.http, source))?;
        server.metrics_addr = metrics
            .as_ref()
            .map(std::net::TcpListener::local_addr)
            .transpose()
            .map_err(|source| bind_error("the metrics address", config.metrics, source))?;

        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("tokwatt-api")
            .build()
            .map_err(ApiError::Runtime)?;
        let mut serving: Vec<Served> = Vec::new();
        {
            let _context = runtime.enter();
            if let Some(listener) = socket_listener {
                let listener = tokio::net::UnixListener::from_std(listener).map_err(|source| {
                    ApiError::Bind {
                        what: "the socket",
                        target: config
                            .socket
                            .as_deref()
                            .unwrap_or(Path::new(""))
                            .display()
                            .to_string(),
                        source,
                    }
                })?;
                serving.push(Served::Unix(
                    listener,
                    routes::control_router(control.clone()),
                ));
            }
            if let Some((listener, token)) = http {
                let listener = tokio::net::TcpListener::from_std(listener)
                    .map_err(|source| bind_error("the HTTP address", config.http, source))?;
                let router = routes::with_token(routes::control_router(control.clone()), token);
                serving.push(Served::Tcp(listener, router));
            }
            if let Some(listener) = metrics {
                let listener = tokio::net::TcpListener::from_std(listener)
                    .map_err(|source| bind_error("the metrics address", config.metrics, source))?;
                serving.push(Served::Tcp(
                    listener,
                    routes::metrics_router(control.clone()),
                ));
            }
        }

        let (stop, stopped) = watch::channel(false);
        let thread = std::thread::Builder::new()
            .name("tokwatt-api".into())
            .spawn(move || serve(runtime, serving, stopped))
            .map_err(ApiError::Runtime)?;
        server.stop = Some(stop);
        server.thread = Some(thread);
        Ok(server)
    }

    /// Serves only `GET /metrics` (from `source`) and `GET /healthz` on `addr`, with the
    /// agent's connection limits: for the fleet's coordinator, which has no control API.
    pub fn start_metrics_only(
        addr: SocketAddr,
        source: Arc<dyn super::MetricsSource>,
    ) -> Result<ApiServer, ApiError> {
        let listener = bind_tcp("the metrics address", addr)?;
        let metrics_addr = listener
            .local_addr()
            .map_err(|source| bind_error("the metrics address", Some(addr), source))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("tokwatt-metrics")
            .build()
            .map_err(ApiError::Runtime)?;
        let serving = {
            let _context = runtime.enter();
            let listener = tokio::net::TcpListener::from_std(listener)
                .map_err(|source| bind_error("the metrics address", Some(addr), source))?;
            vec![Served::Tcp(listener, routes::source_metrics_router(source))]
        };
        let (stop, stopped) = watch::channel(false);
        let thread = std::thread::Builder::new()
            .name("tokwatt-metrics".into())
            .spawn(move || serve(runtime, serving, stopped))
            .map_err(ApiError::Runtime)?;
        Ok(ApiServer {
            stop: Some(stop),
            thread: Some(thread),
            socket: None,
            http_addr: None,
            metrics_addr: Some(metrics_addr),
        })
    }

    /// The socket's path, when serving on one.
    pub fn socket_path(&self) -> Option<&Path> {
        self.socket.as_ref().map(|socket| socket.path.as_path())
    }

    /// The HTTP listener's address (the port chosen when the configuration asked for 0).
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// The metrics listener's address.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Stops accepting, lets requests in flight finish (a few seconds at most), and
    /// removes the socket file.
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the control API's thread panicked");
        }
        if let Some(socket) = self.socket.take() {
            socket.remove();
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop_now();
    }
}

impl OwnedSocket {
    fn remove(self) {
        let ours = fs::symlink_metadata(&self.path)
            .is_ok_and(|meta| meta.dev() == self.device && meta.ino() == self.inode);
        if ours && let Err(error) = fs::remove_file(&self.path) {
            tracing::warn!(
                "could not remove the control socket {}: {error}",
                self.path.display()
            );
        }
    }
}

enum Served {
    Unix(tokio::net::UnixListener, Router),
    Tcp(tokio::net::TcpListener, Router),
}

/// The API thread: serves until told to stop, then gives requests in flight
/// [`STOP_GRACE`] to finish.
fn serve(runtime: tokio::runtime::Runtime, serving: Vec<Served>, stopped: watch::Receiver<bool>) {
    runtime.block_on(async move {
        let mut tasks = Vec::new();
        for served in serving {
            let limits = ConnectionLimits::default();
            tasks.push(match served {
                Served::Unix(listener, router) => {
                    tokio::spawn(accept::serve(listener, router, limits, stopped.clone()))
                }
                Served::Tcp(listener, router) => {
                    tokio::spawn(accept::serve(listener, router, limits, stopped.clone()))
                }
            });
        }
        wait_for_stop(stopped).await;
        let finished = tokio::time::timeout(STOP_GRACE, async {
            for task in tasks {
                let _ = task.await;
            }
        })
        .await;
        if finished.is_err() {
            tracing::warn!(
                "the control API stopped with requests still in flight after {STOP_GRACE:?}"
            );
        }
    });
    runtime.shutdown_timeout(STOP_GRACE);
}

async fn wait_for_stop(mut stopped: watch::Receiver<bool>) {
    // A dropped sender stops the server too.
    let _ = stopped.wait_for(|stop| *stop).await;
}

fn bind_error(what: &'static str, addr: Option<SocketAddr>, source: io::Error) -> ApiError {
    ApiError::Bind {
        what,
        target: addr.map(|addr| addr.to_string()).unwrap_or_default(),
        source,
    }
}

fn bind_tcp(what: &'static str, addr: SocketAddr) -> Result<std::net::TcpListener, ApiError> {
    let listener =
        std::net::TcpListener::bind(addr).map_err(|source| bind_error(what, Some(addr), source))?;
    listener
        .set_nonblocking(true)
        .map_err(|source| bind_error(what, Some(addr), source))?;
    Ok(listener)
}

/// The HTTP listener: loopback only, with a valid token file.
fn http_listener(
    addr: SocketAddr,
    token_file: Option<&Path>,
) -> Result<(std::net::TcpListener, BearerToken), ApiError> {
    if !addr.ip().is_loopback() {
        return Err(ApiError::NotLoopback { addr });
    }
    let token_file = token_file.ok_or(ApiError::NoTokenFile { addr })?;
    let token = BearerToken::from_file(token_file)?;
    Ok((bind_tcp("the HTTP address", addr)?, token))
}

/// Tells staging names apart when one process serves several sockets (tests do).
static STAGING_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Binds the socket at `path`: its folder made (0700) if missing, a stale socket (nobody
/// listening) replaced, a live one or a file that is not a socket refused. The socket is
/// bound under a staging name, made 0600, then renamed into place, so no one can connect
/// before its mode is set.
fn bind_socket(path: &Path) -> Result<(std::os::unix::net::UnixListener, OwnedSocket), ApiError> {
    let folder = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    if !folder.exists() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(folder)
            .map_err(|source| ApiError::SocketFolder {
                path: folder.to_owned(),
                source,
            })?;
    }
    match fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(ApiError::NotASocket {
                path: path.to_owned(),
            });
        }
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => {
                return Err(ApiError::AlreadyServing {
                    path: path.to_owned(),
                });
            }
            Err(error) if error.kind() == io::ErrorKind::ConnectionRefused => {
                tracing::info!("replacing the stale socket {}", path.display());
                fs::remove_file(path).map_err(|source| ApiError::SocketProbe {
                    path: path.to_owned(),
                    source,
                })?;
            }
            Err(source) => {
                return Err(ApiError::SocketProbe {
                    path: path.to_owned(),
                    source,
                });
            }
        },
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(ApiError::SocketProbe {
                path: path.to_owned(),
                source,
            });
        }
    }

    let bind_failed = |source: io::Error| ApiError::Bind {
        what: "the socket",
        target: path.display().to_string(),
        source,
    };
    let staging = folder.join(format!(
        ".tokwatt-{}-{}.sock",
        std::process::id(),
        STAGING_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    if fs::symlink_metadata(&staging).is_ok_and(|meta| meta.file_type().is_socket()) {
        let _ = fs::remove_file(&staging);
    }
    let listener = std::os::unix::net::UnixListener::bind(&staging).map_err(bind_failed)?;
    let placed = fs::set_permissions(&staging, fs::Permissions::from_mode(0o600))
        .and_then(|()| fs::rename(&staging, path))
        .and_then(|()| fs::symlink_metadata(path))
        .and_then(|meta| listener.set_nonblocking(true).map(|()| meta));
    let meta = match placed {
        Ok(meta) => meta,
        Err(error) => {
            let _ = fs::remove_file(&staging);
            return Err(bind_failed(error));
        }
    };
    Ok((
        listener,
        OwnedSocket {
            path: path.to_owned(),
            device: meta.dev(),
            inode: meta.ino(),
        },
    ))
}
