//! systemd's notification protocol (`sd_notify`), without libsystemd: one datagram of
//! `KEY=VALUE` lines to the Unix socket named by `NOTIFY_SOCKET`, which systemd sets for a
//! `Type=notify` service (and for `NotifyAccess=`). `READY=1` says the start is over;
//! `WATCHDOG=1`, sent at least once per `WATCHDOG_USEC` (set with `WatchdogSec=`), keeps
//! systemd's watchdog from aborting the service; `STOPPING=1` says it is stopping.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    #[error(
        "NOTIFY_SOCKET={value:?} is not a Unix socket address (a path, or @name for an abstract socket): {source}"
    )]
    Address {
        value: OsString,
        #[source]
        source: io::Error,
    },
    #[error(
        "WATCHDOG_USEC={value:?} is not a positive whole number of microseconds (systemd sets it from WatchdogSec=)"
    )]
    Watchdog { value: OsString },
    #[error("opening a socket to notify systemd: {0}")]
    Socket(#[source] io::Error),
}

/// The socket systemd listens on for this service, and its watchdog interval.
#[derive(Debug)]
pub struct SystemdNotifier {
    socket: UnixDatagram,
    address: SocketAddr,
    /// `None`: no watchdog for this process (no `WATCHDOG_USEC`, or it is another
    /// process's: `WATCHDOG_PID`).
    watchdog: Option<Duration>,
}

impl SystemdNotifier {
    /// From the environment systemd gives the service (`var` reads a variable; `pid` is
    /// this process's): `None` where there is no `NOTIFY_SOCKET`.
    pub fn from_env(
        var: impl Fn(&str) -> Option<OsString>,
        pid: u32,
    ) -> Result<Option<Self>, NotifyError> {
        let Some(value) = var("NOTIFY_SOCKET").filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        let address =
            socket_address(&value).map_err(|source| NotifyError::Address { value, source })?;
        let watchdog_for_us = var("WATCHDOG_PID").is_none_or(|owner| {
            owner.to_str().and_then(|o| o.trim().parse::<u32>().ok()) == Some(pid)
        });
        let watchdog = match var("WATCHDOG_USEC") {
            Some(usec) if watchdog_for_us => {
                let micros = usec
                    .to_str()
                    .and_then(|u| u.trim().parse::<u64>().ok())
                    .filter(|&micros| micros > 0)
                    .ok_or(NotifyError::Watchdog { value: usec })?;
                Some(Duration::from_micros(micros))
            }
            _ => None,
        };
        let socket = UnixDatagram::unbound().map_err(NotifyError::Socket)?;
        Ok(Some(Self {
            socket,
            address,
            watchdog,
        }))
    }

    /// From this process's environment.
    pub fn from_process_env() -> Result<Option<Self>, NotifyError> {
        Self::from_env(|name| std::env::var_os(name), std::process::id())
    }

    /// systemd's watchdog interval for this process, if it has one.
    pub fn watchdog(&self) -> Option<Duration> {
        self.watchdog
    }

    /// Sends `message` (`READY=1`, `WATCHDOG=1`, `STOPPING=1`, …) as one datagram.
    pub fn notify(&self, message: &str) -> io::Result<()> {
        self.socket
            .send_to_addr(message.as_bytes(), &self.address)
            .map(|_| ())
    }
}

/// `NOTIFY_SOCKET`'s address: a path, or an abstract socket's name after `@`.
fn socket_address(value: &std::ffi::OsStr) -> io::Result<SocketAddr> {
    let bytes = value.as_bytes();
    match bytes.strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(name)
        }
        None => SocketAddr::from_pathname(std::path::Path::new(value)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let pairs: Vec<(String, OsString)> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), OsString::from(v)))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn without_notify_socket_there_is_nothing_to_notify() {
        let none = SystemdNotifier::from_env(env(&[("WATCHDOG_USEC", "5000000")]), 7);
        assert!(none.expect("no error").is_none());
    }

    #[test]
    fn a_path_socket_receives_each_message_as_one_datagram() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify.sock");
        let systemd = UnixDatagram::bind(&path).expect("bind");
        let path_text = path.to_str().expect("UTF-8 path");
        let notifier = SystemdNotifier::from_env(
            env(&[("NOTIFY_SOCKET", path_text), ("WATCHDOG_USEC", "2500000")]),
            7,
        )
        .expect("valid")
        .expect("a notifier");
        assert_eq!(notifier.watchdog(), Some(Duration::from_millis(2500)));
        notifier.notify("READY=1").expect("sent");
        notifier.notify("WATCHDOG=1").expect("sent");
        let mut buffer = [0_u8; 64];
        let n = systemd.recv(&mut buffer).expect("received");
        assert_eq!(&buffer[..n], b"READY=1");
        let n = systemd.recv(&mut buffer).expect("received");
        assert_eq!(&buffer[..n], b"WATCHDOG=1");
    }

    #[test]
    fn an_abstract_socket_is_named_after_an_at_sign() {
        let name = format!("tokwatt-notify-test-{}", std::process::id());
        let address = {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(name.as_bytes()).expect("an abstract name")
        };
        let systemd = UnixDatagram::bind_addr(&address).expect("bind");
        let notifier = SystemdNotifier::from_env(env(&[("NOTIFY_SOCKET", &format!("@{name}"))]), 7)
            .expect("valid")
            .expect("a notifier");
        assert_eq!(notifier.watchdog(), None);
        notifier.notify("READY=1").expect("sent");
        let mut buffer = [0_u8; 16];
        let n = systemd.recv(&mut buffer).expect("received");
        assert_eq!(&buffer[..n], b"READY=1");
    }

    #[test]
    fn another_processs_watchdog_is_not_ours_and_a_bad_interval_is_refused() {
        let theirs = SystemdNotifier::from_env(
            env(&[
                ("NOTIFY_SOCKET", "/run/systemd/notify"),
                ("WATCHDOG_USEC", "5000000"),
                ("WATCHDOG_PID", "8"),
            ]),
            7,
        )
        .expect("valid")
        .expect("a notifier");
        assert_eq!(theirs.watchdog(), None);
        let ours = SystemdNotifier::from_env(
            env(&[
                ("NOTIFY_SOCKET", "/run/systemd/notify"),
                ("WATCHDOG_USEC", "5000000"),
                ("WATCHDOG_PID", "7"),
            ]),
            7,
        )
        .expect("valid")
        .expect("a notifier");
        assert_eq!(ours.watchdog(), Some(Duration::from_secs(5)));
        let error = SystemdNotifier::from_env(
            env(&[
                ("NOTIFY_SOCKET", "/run/systemd/notify"),
                ("WATCHDOG_USEC", "5s"),
            ]),
            7,
        )
        .expect_err("refused");
        assert!(error.to_string().contains("WATCHDOG_USEC"), "{error}");
    }
}
