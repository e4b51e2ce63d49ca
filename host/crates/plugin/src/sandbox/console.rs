//! The bounded console: what a guest writes to its standard output and error, the newest
//! bytes of each kept with a count of the rest, and its log messages.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

use crate::text::{PLUGIN_TEXT_MAX_BYTES, sanitize_text};

/// How much of each of a guest's output streams (standard output, standard error) the
/// host keeps: the newest bytes. A guest writing more costs the host only this buffer
/// and a count of the bytes it no longer holds.
pub const GUEST_OUTPUT_TAIL_BYTES: usize = 16 * 1024;

/// How much of the standard error a failed call wrote is quoted in its failure message:
/// its end, where a traceback names the exception and a panic its message.
pub(crate) const FAILURE_TAIL_BYTES: usize = 1024;

/// Log messages kept for [`GuestConsole::take`] between two takes (only while
/// transcribing); further ones are counted.
pub(crate) const MAX_TRANSCRIBED_LOGS: usize = 256;

/// The newest bytes written to one stream, and how many were written in all.
#[derive(Debug, Default)]
pub(crate) struct TailBuffer {
    pub(crate) held: VecDeque<u8>,
    pub(crate) written: u64,
}

impl TailBuffer {
    pub(crate) fn push(&mut self, data: &[u8]) {
        self.written = self.written.saturating_add(data.len() as u64);
        // Only the end of a large write can survive; the rest is never copied.
        let kept = &data[data.len().saturating_sub(GUEST_OUTPUT_TAIL_BYTES)..];
        let overflow = (self.held.len() + kept.len()).saturating_sub(GUEST_OUTPUT_TAIL_BYTES);
        self.held.drain(..overflow);
        self.held.extend(kept);
    }

    /// The bytes written since the stream had `mark` bytes written, as far as they are
    /// still held, and how many of them are not.
    pub(crate) fn since(&self, mark: u64) -> (Vec<u8>, u64) {
        let wanted = self.written.saturating_sub(mark);
        let held = self.held.len();
        let have = usize::try_from(wanted).map_or(held, |wanted| wanted.min(held));
        let bytes = self.held.range(held - have..).copied().collect();
        (bytes, wanted - have as u64)
    }
}

/// One log message a guest sent through the contract's `log`, escaped.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GuestLog {
    /// `trace`, `debug`, `info`, `warn` or `error`.
    pub level: &'static str,
    pub message: String,
}

/// What a guest wrote between two [`GuestConsole::take`]s. Every line is escaped and
/// bounded (`plugin::text`), so it is safe to print.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct GuestOutput {
    pub stdout: Vec<String>,
    /// Bytes written to standard output that the bounded buffer no longer held.
    pub stdout_bytes_lost: u64,
    pub stderr: Vec<String>,
    pub stderr_bytes_lost: u64,
    /// Log messages that passed the per-call rate limit (only while transcribing).
    pub logs: Vec<GuestLog>,
    /// Log messages past [`MAX_TRANSCRIBED_LOGS`] between two takes.
    pub logs_lost: u64,
}

impl GuestOutput {
    pub fn is_empty(&self) -> bool {
        self.stdout.is_empty()
            && self.stderr.is_empty()
            && self.logs.is_empty()
            && self.stdout_bytes_lost == 0
            && self.stderr_bytes_lost == 0
            && self.logs_lost == 0
    }
}

#[derive(Debug, Default)]
pub(crate) struct ConsoleState {
    pub(crate) stdout: TailBuffer,
    pub(crate) stderr: TailBuffer,
    /// `written` of each stream at the last take.
    pub(crate) stdout_taken: u64,
    pub(crate) stderr_taken: u64,
    pub(crate) transcribe_logs: bool,
    pub(crate) logs: Vec<GuestLog>,
    pub(crate) logs_lost: u64,
}

/// A guest's console: its standard output and error (bounded tails) and, when asked, a
/// transcript of its log messages. Shared by the instances a `WasmPolicy` rebuilds, so
/// what a trapped instance wrote is still there after the rebuild.
#[derive(Debug, Clone, Default)]
pub struct GuestConsole(pub(crate) Arc<Mutex<ConsoleState>>);

impl GuestConsole {
    pub(crate) fn state(&self) -> MutexGuard<'_, ConsoleState> {
        // The state stays consistent whatever panicked while holding it: every update
        // is complete before the next.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keep the guest's log messages for [`GuestConsole::take`] (what `tokwatt replay`
    /// shows), besides sending them to the agent's log.
    pub fn transcribe_logs(&self, on: bool) {
        self.state().transcribe_logs = on;
    }

    /// What the guest wrote since the last take.
    pub fn take(&self) -> GuestOutput {
        let mut state = self.state();
        let (stdout, stdout_bytes_lost) = state.stdout.since(state.stdout_taken);
        let (stderr, stderr_bytes_lost) = state.stderr.since(state.stderr_taken);
        state.stdout_taken = state.stdout.written;
        state.stderr_taken = state.stderr.written;
        GuestOutput {
            stdout: escaped_lines(&stdout),
            stdout_bytes_lost,
            stderr: escaped_lines(&stderr),
            stderr_bytes_lost,
            logs: std::mem::take(&mut state.logs),
            logs_lost: std::mem::take(&mut state.logs_lost),
        }
    }

    pub(crate) fn write(&self, stream: Stream, data: &[u8]) {
        let mut state = self.state();
        match stream {
            Stream::Stdout => state.stdout.push(data),
            Stream::Stderr => state.stderr.push(data),
        }
    }

    pub(crate) fn stderr_written(&self) -> u64 {
        self.state().stderr.written
    }

    /// The end of what was written to standard error since `mark` (at most
    /// [`FAILURE_TAIL_BYTES`], raw) and how many bytes came before it; `None` if nothing
    /// but white space was written.
    pub(crate) fn stderr_tail_raw_since(&self, mark: u64) -> Option<(String, u64)> {
        let (bytes, lost) = self.state().stderr.since(mark);
        let start = bytes.len().saturating_sub(FAILURE_TAIL_BYTES);
        let text = String::from_utf8_lossy(&bytes[start..]);
        if text.trim().is_empty() {
            return None;
        }
        Some((text.into_owned(), lost + start as u64))
    }

    /// The end of what was written to standard error since `mark`, escaped, as one
    /// line; `None` if nothing was.
    pub(crate) fn stderr_tail_since(&self, mark: u64) -> Option<String> {
        let (text, earlier) = self.stderr_tail_raw_since(mark)?;
        // An escape takes at most 8 bytes per byte of text (`\u{1b}` for one), so the
        // bound never cuts the end, where the message that matters is.
        let shown = sanitize_text(text.trim(), 8 * FAILURE_TAIL_BYTES);
        Some(if earlier > 0 {
            format!("… ({earlier} bytes before) {shown}")
        } else {
            shown
        })
    }

    /// The same tail as [`GuestConsole::stderr_tail_since`], one entry per line the
    /// guest wrote (its indentation kept), each escaped: only the line breaks become
    /// real, so a reader can show a traceback as written while a guest still cannot
    /// write control characters to the operator's terminal. The first entry says how
    /// many bytes came before, if any were left out.
    pub(crate) fn stderr_tail_lines_since(&self, mark: u64) -> Vec<String> {
        let Some((text, earlier)) = self.stderr_tail_raw_since(mark) else {
            return Vec::new();
        };
        let mut lines = Vec::new();
        if earlier > 0 {
            lines.push(format!("… ({earlier} bytes before)"));
        }
        let text = text.trim_start_matches(['\n', '\r']).trim_end();
        lines.extend(text.split('\n').map(|line| {
            let line = line.strip_suffix('\r').unwrap_or(line);
            sanitize_text(line, 8 * FAILURE_TAIL_BYTES)
        }));
        lines
    }

    pub(crate) fn log(&self, level: &'static str, message: &str) {
        let mut state = self.state();
        if !state.transcribe_logs {
            return;
        }
        if state.logs.len() < MAX_TRANSCRIBED_LOGS {
            state.logs.push(GuestLog {
                level,
                message: message.to_owned(),
            });
        } else {
            state.logs_lost += 1;
        }
    }
}

/// Each line of `bytes` (invalid UTF-8 replaced), escaped and bounded.
pub(crate) fn escaped_lines(bytes: &[u8]) -> Vec<String> {
    if bytes.is_empty() {
        return Vec::new();
    }
    let text = String::from_utf8_lossy(bytes);
    text.strip_suffix('\n')
        .unwrap_or(&text)
        .split('\n')
        .map(|line| sanitize_text(line, PLUGIN_TEXT_MAX_BYTES))
        .collect()
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Stream {
    Stdout,
    Stderr,
}

/// One of the guest's output streams, writing into its [`GuestConsole`]. Always ready
/// and never blocking (a guest waiting in `wasi:io/poll.poll` is beyond fuel and the
/// epoch deadline), never failing (a failed write to standard error makes a Rust
/// guest's `eprintln!` panic).
#[derive(Debug, Clone)]
pub(crate) struct ConsoleStream {
    pub(crate) console: GuestConsole,
    pub(crate) stream: Stream,
}

impl Pollable for ConsoleStream {
    fn ready<'life0, 'async_trait>(
        &'life0 mut self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(std::future::ready(()))
    }
}

impl OutputStream for ConsoleStream {
    fn write(&mut self, bytes: bytes::Bytes) -> StreamResult<()> {
        self.console.write(self.stream, &bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        // The size wasmtime-wasi's own always-ready sink offers.
        Ok(64 * 1024)
    }
}

impl tokio::io::AsyncWrite for ConsoleStream {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.console.write(self.stream, buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl IsTerminal for ConsoleStream {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for ConsoleStream {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}
