//! Each listener's accept loop. An idle or slow client holds its connection for as long
//! as it likes unless something closes it, and the metrics port listens on every address:
//! without bounds, enough such clients would hold the listener shut (the liveness probe
//! reads `/metrics`, so the pod would be restarted in a loop) or exhaust the agent's file
//! handles (the recorder's next rotation would fail and end the loop). So:
//!
//! - every connection is HTTP/1 with a header-read timeout, which hyper also runs while a
//!   kept-alive connection waits for its next request, so a silent or one-byte-a-second
//!   client is closed when it runs out;
//! - at most [`MAX_CONNECTIONS`] are open on one listener; when a new client comes to a
//!   full listener, the connection that has waited longest without a request in progress
//!   is closed to make room (a request in progress is never cut). Only when every open
//!   connection is in a request is the newcomer closed instead.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use axum::serve::Listener;
use hyper::body::Incoming;
use hyper::service::Service;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::{Notify, watch};

/// Connections one listener holds open at most: an operator's CLI, a Prometheus server
/// and a few dashboards need a handful; three listeners stay far inside the usual limit
/// of 1024 open files.
pub const MAX_CONNECTIONS: usize = 128;

/// How long a client has to send a request's head, and how long a kept-alive connection
/// may wait for its next one.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How a listener treats its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: MAX_CONNECTIONS,
            header_read_timeout: HEADER_READ_TIMEOUT,
        }
    }
}

/// One open connection: since when it has had no request in progress (`None`: one is in
/// progress), and how to close it.
struct Slot {
    idle_since: Option<Instant>,
    close: Arc<Notify>,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    slots: HashMap<u64, Slot>,
    /// Connections closed to make room, for tests and the log.
    evicted: u64,
}

#[derive(Clone, Default)]
struct Connections(Arc<Mutex<Table>>);

impl Connections {
    fn lock(&self) -> MutexGuard<'_, Table> {
        // A panic while holding the lock leaves a table that is still a table.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Room for one more: `Some` with its id and closer, after closing the connection
    /// idle the longest if the listener is full; `None` when every connection is busy.
    fn admit(&self, max: usize) -> Option<(u64, Arc<Notify>)> {
        let mut table = self.lock();
        if table.slots.len() >= max {
            let oldest = table
                .slots
                .iter()
                .filter_map(|(&id, slot)| slot.idle_since.map(|since| (since, id)))
                .min()
                .map(|(_, id)| id)?;
            if let Some(slot) = table.slots.remove(&oldest) {
                slot.close.notify_one();
                table.evicted += 1;
            }
        }
        let id = table.next_id;
        table.next_id += 1;
        let close = Arc::new(Notify::new());
        table.slots.insert(
            id,
            Slot {
                idle_since: Some(Instant::now()),
                close: Arc::clone(&close),
            },
        );
        Some((id, close))
    }

    fn set_busy(&self, id: u64, busy: bool) {
        if let Some(slot) = self.lock().slots.get_mut(&id) {
            slot.idle_since = (!busy).then(Instant::now);
        }
    }

    fn remove(&self, id: u64) {
        self.lock().slots.remove(&id);
    }
}

/// Serve `router` on `listener` until `stop` turns true; then each connection finishes
/// the request it is in and closes.
pub async fn serve<L>(
    mut listener: L,
    router: Router,
    limits: ConnectionLimits,
    stop: watch::Receiver<bool>,
) where
    L: Listener,
{
    let connections = Connections::default();
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stopped(stop.clone()) => break,
        };
        let (io, _addr) = accepted;
        let Some((id, close)) = connections.admit(limits.max_connections) else {
            // Every connection is in a request: this one waits for none of them.
            tracing::warn!(
                max = limits.max_connections,
                "a listener of the control API is full of requests in progress; a new connection was closed"
            );
            drop(io);
            continue;
        };
        let hyper_service = TowerToHyperService::new(router.clone());
        let tracked = connections.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            tracked.set_busy(id, true);
            let response = hyper_service.call(request);
            let tracked = tracked.clone();
            async move {
                let response = response.await;
                tracked.set_busy(id, false);
                response
            }
        });
        let stop = stop.clone();
        let connections = connections.clone();
        tasks.spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout);
            let connection = builder.serve_connection(TokioIo::new(io), service);
            let mut connection = std::pin::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                // Closed to make room: dropping the connection closes it.
                () = close.notified() => {}
                () = stopped(stop) => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
            connections.remove(id);
        });
        // Reap finished connections as we go, so the set does not grow without end.
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    // A dropped sender stops the server too.
    let _ = stop.wait_for(|stop| *stop).await;
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap
mod tests {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};

    use super::*;

    /// A listener on a thread of its own, serving `GET /` with "ok".
    fn start(
        limits: ConnectionLimits,
    ) -> (SocketAddr, watch::Sender<bool>, std::thread::JoinHandle<()>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = watch::channel(false);
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let router = Router::new().route("/", axum::routing::get(|| async { "ok" }));
                serve(listener, router, limits, stopped).await;
            });
        });
        (addr, stop, thread)
    }

    /// `GET /` on a fresh connection, giving up after `patience`.
    fn get(addr: SocketAddr, patience: Duration) -> std::io::Result<String> {
        let mut stream = TcpStream::connect_timeout(&addr, patience)?;
        stream.set_read_timeout(Some(patience))?;
        stream.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer)?;
        Ok(answer)
    }

    #[test]
    fn a_request_is_answered_while_a_thousand_idle_and_slow_clients_are_connected() {
        // The header timeout is far longer than the patience below: the answer comes
        // because idle clients make room, not because they timed out.
        let (addr, stop, thread) = start(ConnectionLimits {
            max_connections: 64,
            header_read_timeout: Duration::from_secs(60),
        });
        let mut idle: Vec<TcpStream> = (0..1000)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        // Half of them send one byte of a request head, as a slow client would each second.
        for stream in idle.iter_mut().step_by(2) {
            stream.write_all(b"G").unwrap();
        }
        for _ in 0..3 {
            let answer = get(addr, Duration::from_secs(5)).expect("answered");
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            assert!(answer.ends_with("ok"), "{answer}");
        }
        stop.send(true).unwrap();
        drop(idle);
        thread.join().unwrap();
    }

    #[test]
    fn a_silent_client_and_an_idle_kept_alive_one_are_closed_at_the_header_timeout() {
        let (addr, stop, thread) = start(ConnectionLimits {
            max_connections: 64,
            header_read_timeout: Duration::from_millis(300),
        });
        let mut silent = TcpStream::connect(addr).unwrap();
        silent
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut kept = TcpStream::connect(addr).unwrap();
        kept.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        kept.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut buf = [0u8; 4096];
        let n = kept.read(&mut buf).unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        // Both are closed by the server (a read of 0 bytes, or a reset), not left open
        // until the test's own 10 s read timeout.
        for (name, stream) in [("silent", &mut silent), ("kept alive", &mut kept)] {
            let started = Instant::now();
            let read = stream.read(&mut buf);
            assert!(
                matches!(read, Ok(0))
                    || matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
                "{name}: {read:?}"
            );
            assert!(
                started.elapsed() < Duration::from_secs(9),
                "{name}: closed by the server, not the test's timeout"
            );
        }
        stop.send(true).unwrap();
        thread.join().unwrap();
    }

    #[test]
    fn a_full_listener_closes_the_connection_idle_the_longest() {
        let connections = Connections::default();
        let (first, first_close) = connections.admit(2).unwrap();
        let (second, _) = connections.admit(2).unwrap();
        // The first is in a request: the second, idle, makes room.
        connections.set_busy(first, true);
        let (_third, _) = connections.admit(2).unwrap();
        let table = connections.lock();
        assert!(table.slots.contains_key(&first));
        assert!(!table.slots.contains_key(&second));
        assert_eq!(table.evicted, 1);
        drop(table);
        drop(first_close);
        // Every one busy: no room, and nobody in a request is cut.
        let connections = Connections::default();
        let (a, _) = connections.admit(1).unwrap();
        connections.set_busy(a, true);
        assert!(connections.admit(1).is_none());
    }
}
