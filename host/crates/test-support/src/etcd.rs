//! A real etcd cluster on loopback for tests: Debian's `etcd-server`, one process per
//! member, each with its own data folder, all killed when the cluster is dropped. Its
//! client URLs are plain http, or https with a [`ServerTls`] (peers talk plain on
//! loopback either way); each member's health is read on a plain metrics port of its own.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{free_port, skip_unless_required};

/// The variable that makes a missing etcd a test failure.
pub const REQUIRE_ETCD_VAR: &str = "TOKWATT_REQUIRE_ETCD";

/// A running cluster.
#[derive(Debug)]
pub struct EtcdCluster {
    dir: PathBuf,
    members: Vec<Member>,
    tls: Option<ServerTls>,
}

/// TLS on the members' client URLs.
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// The server certificate (`--cert-file`) and its key (`--key-file`).
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// Where set, a client must present a certificate signed by this CA
    /// (`--client-cert-auth --trusted-ca-file`).
    pub client_ca: Option<PathBuf>,
}

impl ServerTls {
    /// The server certificate of `pki`, with client certificates required or not.
    pub fn from_pki(pki: &crate::TestPki, require_client_cert: bool) -> Self {
        Self {
            cert_file: pki.server_cert.clone(),
            key_file: pki.server_key.clone(),
            client_ca: require_client_cert.then(|| pki.ca.clone()),
        }
    }
}

#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    /// Plain http `/health` (`--listen-metrics-urls`), whatever the client URLs speak.
    metrics_port: u16,
    process: Option<Child>,
}

impl EtcdCluster {
    /// `members` members on loopback, healthy; `None` (the test skipped, with the reason)
    /// where etcd is not installed and [`REQUIRE_ETCD_VAR`] is not set.
    #[track_caller]
    pub fn start(members: usize) -> Option<Self> {
        Self::start_with(members, None)
    }

    /// A fresh PKI and one member requiring client certificates signed by its CA: the
    /// PKI (which owns the files) and the cluster, or `None` where either was skipped.
    #[track_caller]
    pub fn start_tls_one() -> Option<(crate::TestPki, Self)> {
        let pki = crate::TestPki::generate()?;
        let cluster = Self::start_tls(1, ServerTls::from_pki(&pki, true))?;
        Some((pki, cluster))
    }

    /// `members` members whose client URLs are https with `tls`; skipped as [`Self::start`].
    #[track_caller]
    pub fn start_tls(members: usize, tls: ServerTls) -> Option<Self> {
        Self::start_with(members, Some(tls))
    }

    #[track_caller]
    fn start_with(members: usize, tls: Option<ServerTls>) -> Option<Self> {
        let found = Command::new("etcd")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            skip_unless_required(
                REQUIRE_ETCD_VAR,
                "etcd is not installed (apt-get install etcd-server)",
            );
            return None;
        }
        let dir = std::env::temp_dir().join(format!(
            "tokwatt-etcd-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).expect("the cluster's folder");
        let members: Vec<Member> = (0..members)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: free_port(),
                peer_port: free_port(),
                metrics_port: free_port(),
                process: None,
            })
            .collect();
        let mut cluster = Self { dir, members, tls };
        for i in 0..cluster.members.len() {
            cluster.spawn(i, "new");
        }
        for i in 0..cluster.members.len() {
            cluster.wait_healthy(i, Duration::from_secs(30));
        }
        Some(cluster)
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn spawn(&mut self, i: usize, state: &str) {
        let initial = self.initial_cluster();
        let data = self.dir.join(&self.members[i].name);
        let log = std::fs::File::create(self.dir.join(format!("{}.log", self.members[i].name)))
            .expect("the member's log");
        let scheme = self.scheme();
        let mut command = Command::new("etcd");
        if let Some(tls) = &self.tls {
            command
                .arg("--cert-file")
                .arg(&tls.cert_file)
                .arg("--key-file")
                .arg(&tls.key_file);
            if let Some(ca) = &tls.client_ca {
                command
                    .arg("--client-cert-auth")
                    .arg("--trusted-ca-file")
                    .arg(ca);
            }
        }
        let member = &mut self.members[i];
        let client = format!("{scheme}://127.0.0.1:{}", member.client_port);
        let peer = format!("http://127.0.0.1:{}", member.peer_port);
        let metrics = format!("http://127.0.0.1:{}", member.metrics_port);
        let child = command
            .args(["--name", &member.name])
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--listen-metrics-urls", &metrics])
            .args(["--initial-cluster", &initial])
            .args(["--initial-cluster-state", state])
            .args(["--initial-cluster-token", "tokwatt-test"])
            // Fast elections on loopback: a killed leader is replaced within a second.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd starts");
        member.process = Some(child);
    }

    fn wait_healthy(&self, i: usize, patience: Duration) {
        let start = Instant::now();
        let port = self.members[i].metrics_port;
        while start.elapsed() < patience {
            if health(port) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let log = std::fs::read_to_string(self.dir.join(format!("{}.log", self.members[i].name)))
            .unwrap_or_default();
        let tail: String = log.lines().rev().take(20).collect::<Vec<_>>().join("\n");
        panic!("etcd member {i} is not healthy after {patience:?}; its log ends:\n{tail}");
    }

    fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }

    /// Every member's client URL (`http://127.0.0.1:PORT`, or `https://` with TLS),
    /// killed ones included.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("{}://127.0.0.1:{}", self.scheme(), m.client_port))
            .collect()
    }

    /// Kills member `i` with SIGKILL.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].process.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts member `i` again on its data folder, and waits until it is healthy.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i, "existing");
        self.wait_healthy(i, Duration::from_secs(30));
    }
}

/// Whether the member answers `/health` with `"health":"true"`.
fn health(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.contains("\"health\":\"true\"")
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
