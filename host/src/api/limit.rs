//! At most so many connections open per listener. An idle or slow client holds its
//! connection (and a file handle) for as long as it likes; without a bound, enough of them
//! would exhaust the process's handles, and the recorder's next rotation would fail and
//! end the control loop. Past the bound, accepting waits for a connection to close: new
//! clients wait in the kernel's backlog, and the agent's handles stay bounded.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::serve::Listener;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Connections one listener holds open at most: an operator's CLI, a Prometheus server
/// and a few dashboards need a handful.
pub const MAX_CONNECTIONS: usize = 64;

/// A listener that accepts only while fewer than its bound of connections are open.
pub struct Limited<L> {
    inner: L,
    permits: Arc<Semaphore>,
}

impl<L> Limited<L> {
    pub fn new(inner: L, max_connections: usize) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(max_connections)),
        }
    }
}

impl<L: Listener> Listener for Limited<L> {
    type Io = Counted<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        // The semaphore is never closed, so waiting for a permit only ends with one.
        let permit = loop {
            if let Ok(permit) = Arc::clone(&self.permits).acquire_owned().await {
                break permit;
            }
        };
        let (io, addr) = self.inner.accept().await;
        (
            Counted {
                io,
                _permit: permit,
            },
            addr,
        )
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A connection that gives its place back when it closes.
pub struct Counted<Io> {
    io: Io,
    _permit: OwnedSemaphorePermit,
}

impl<Io: AsyncRead + Unpin> AsyncRead for Counted<Io> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Counted<Io> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_listener_past_its_bound_waits_for_a_connection_to_close() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = tcp.local_addr().unwrap();
            let mut limited = Limited::new(tcp, 2);
            let mut clients = Vec::new();
            for _ in 0..3 {
                clients.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            }
            let (first, _) = limited.accept().await;
            let (_second, _) = limited.accept().await;
            // The third waits in the backlog while two are open...
            let waited = tokio::time::timeout(Duration::from_millis(200), limited.accept()).await;
            assert!(
                waited.is_err(),
                "a third connection was accepted past the bound"
            );
            // ...and is accepted once one closes.
            drop(first);
            let third = tokio::time::timeout(Duration::from_secs(10), limited.accept()).await;
            assert!(
                third.is_ok(),
                "the freed place was not given to the waiting client"
            );
        });
    }
}
