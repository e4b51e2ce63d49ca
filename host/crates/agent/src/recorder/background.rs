//! The output files written on a thread of their own, from a bounded queue, while the
//! loop goes on ([`super::Recorder::write_in_background`]: a run on a virtual clock).

use std::path::{Path, PathBuf};

use super::{Files, RecorderError, TickRecord};

/// The files, written on a thread of their own from a bounded queue.
#[derive(Debug)]
pub(super) struct Background {
    /// `None` once closed (the thread then drains the queue and ends).
    to: Option<std::sync::mpsc::SyncSender<Message>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The first error the thread met; it writes nothing after it.
    failed: std::sync::Arc<std::sync::Mutex<Option<RecorderError>>>,
}

#[derive(Debug)]
pub(super) enum Message {
    Tick(Box<TickRecord>),
    Requests(u32, Vec<tokwatt_core::workload::serving::RequestRecord>),
    EndTick,
    /// Flush, then answer.
    Flush(std::sync::mpsc::Sender<()>),
}

/// Ticks' lines the background writer may fall behind by before the loop waits for it
/// (each a GPU's tick: a few hundred bytes each, so memory stays bounded).
const BACKGROUND_QUEUE: usize = 4096;

impl Background {
    pub(super) fn start(dir: PathBuf, mut files: Box<Files>) -> Result<Self, RecorderError> {
        let (to, from) = std::sync::mpsc::sync_channel::<Message>(BACKGROUND_QUEUE);
        let failed = std::sync::Arc::new(std::sync::Mutex::new(None));
        let theirs = std::sync::Arc::clone(&failed);
        let thread = std::thread::Builder::new()
            .name("tokwatt-recorder".into())
            .spawn(move || {
                for message in from {
                    let stopped = theirs
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .is_some();
                    let (result, ack) = match message {
                        _ if stopped => (Ok(()), None),
                        Message::Tick(record) => (files.write_tick(&dir, &record), None),
                        Message::Requests(gpu, records) => {
                            (files.write_requests(&dir, gpu, &records), None)
                        }
                        Message::EndTick => (files.flush(), None),
                        Message::Flush(ack) => (files.flush(), Some(ack)),
                    };
                    if let Err(error) = result {
                        *theirs
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(error);
                    }
                    if let Some(ack) = ack {
                        let _ = ack.send(());
                    }
                }
                let _ = files.flush();
            })
            .map_err(|source| RecorderError::Write {
                path: PathBuf::from("(the output writer thread)"),
                source,
            })?;
        Ok(Self {
            to: Some(to),
            thread: Some(thread),
            failed,
        })
    }

    /// The thread's first error, if it met one.
    fn failed(&self) -> Result<(), RecorderError> {
        match self
            .failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    pub(super) fn send(&self, dir: &Path, message: Message) -> Result<(), RecorderError> {
        self.failed()?;
        let sent = self.to.as_ref().map(|to| to.send(message));
        match sent {
            Some(Ok(())) => Ok(()),
            _ => Err(RecorderError::Write {
                path: dir.to_owned(),
                source: std::io::Error::other("the output writer thread stopped"),
            }),
        }
    }

    /// Everything queued written and flushed.
    pub(super) fn flush(&self, dir: &Path) -> Result<(), RecorderError> {
        let (ack, answered) = std::sync::mpsc::channel();
        self.send(dir, Message::Flush(ack))?;
        if answered.recv().is_err() {
            return Err(RecorderError::Write {
                path: dir.to_owned(),
                source: std::io::Error::other("the output writer thread stopped"),
            });
        }
        self.failed()
    }
}

impl Drop for Background {
    /// What is queued is written before the recorder goes, however the run ends.
    fn drop(&mut self) {
        self.to = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
