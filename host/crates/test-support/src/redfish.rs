//! A Redfish BMC on loopback for the off-node fence's tests: `sushy-emulator` (OpenStack's
//! sushy-tools, from PyPI) with its fake systems driver (no libvirt: each system is a
//! record whose power state changes a few seconds after it is asked to), over https with
//! a certificate from [`TestPki`] (the fence agents speak only https), behind HTTP basic
//! authentication, its state in a folder of its own (the driver's default is shared by
//! every emulator on the machine). The ClusterLabs fence agents (Debian's `fence-agents`)
//! are what the tests drive against it.

use std::io::Read;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{TestPki, free_port, skip_unless_required};

/// The variable that makes missing fence agents or sushy-tools a test failure.
pub const REQUIRE_FENCE_AGENTS_VAR: &str = "TOKWATT_REQUIRE_FENCE_AGENTS";

/// The sushy-tools version the tests were written against (`.ci/run` installs it).
pub const SUSHY_TOOLS_VERSION: &str = "2.2.0";

/// Where a fence agent is installed: on `PATH`, or in /usr/sbin or /sbin (Debian's
/// `fence-agents`, outside a non-root user's `PATH`). `None` (the test skipped, with the
/// reason) where it is not, or does not run, and [`REQUIRE_FENCE_AGENTS_VAR`] is not set.
#[track_caller]
pub fn fence_agent(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|folder| folder.join(name))
        .find(|path| path.is_file());
    let runs = found.as_ref().is_some_and(|path| {
        Command::new(path)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if !runs {
        skip_unless_required(
            REQUIRE_FENCE_AGENTS_VAR,
            format!(
                "the fence agent {name} is not installed or does not run (apt-get install fence-agents)"
            ),
        );
        return None;
    }
    found
}

/// One system the emulator serves.
#[derive(Debug, Clone)]
pub struct FakeSystem {
    pub name: String,
    pub uuid: String,
    /// Powered on at start.
    pub on: bool,
}

impl FakeSystem {
    /// A system named `name`, powered on; its UUID made from `index`.
    pub fn on(name: &str, index: u32) -> Self {
        Self {
            name: name.to_owned(),
            uuid: format!("7a0c1b2e-0000-4000-8000-{index:012}"),
            on: true,
        }
    }

    /// Its Redfish resource (`fence_redfish`'s `systems-uri`).
    pub fn systems_uri(&self) -> String {
        format!("/redfish/v1/Systems/{}", self.uuid)
    }
}

/// A running `sushy-emulator`, killed when dropped.
#[derive(Debug)]
pub struct RedfishEmulator {
    dir: PathBuf,
    process: Option<Child>,
    pki: TestPki,
    pub port: u16,
    pub username: String,
    /// A file holding the password (as an operator's `password_file`).
    pub password_file: PathBuf,
    pub systems: Vec<FakeSystem>,
}

impl RedfishEmulator {
    /// An emulator on a free loopback port serving `systems`, one user (`username`,
    /// `password`); `None` (the test skipped, with the reason) where sushy-tools or
    /// openssl is missing and [`REQUIRE_FENCE_AGENTS_VAR`] is not set.
    ///
    /// # Panics
    ///
    /// Where they are there but the emulator does not come up.
    #[track_caller]
    pub fn start(systems: Vec<FakeSystem>, username: &str, password: &str) -> Option<Self> {
        let Some(emulator) = find_sushy_emulator() else {
            skip_unless_required(
                REQUIRE_FENCE_AGENTS_VAR,
                format!(
                    "sushy-emulator is not installed (pip install --user sushy-tools=={SUSHY_TOOLS_VERSION})"
                ),
            );
            return None;
        };
        let openssl = Command::new("openssl")
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !openssl {
            skip_unless_required(
                REQUIRE_FENCE_AGENTS_VAR,
                "openssl is not installed (apt-get install openssl): no certificate for the emulated BMC",
            );
            return None;
        }
        let pki = TestPki::generate()?;
        let python = interpreter_of(&emulator);
        let dir = std::env::temp_dir().join(format!(
            "tokwatt-redfish-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).expect("the emulator's folder");
        // The emulator checks bcrypt digests only (Apache's htpasswd format): made with
        // the bcrypt module sushy-tools itself depends on.
        let digest = Command::new(&python)
            .args([
                "-c",
                "import bcrypt, sys; print(bcrypt.hashpw(sys.argv[1].encode(), bcrypt.gensalt(4)).decode())",
                password,
            ])
            .output()
            .expect("the emulator's python runs");
        assert!(
            digest.status.success(),
            "bcrypt failed: {}",
            String::from_utf8_lossy(&digest.stderr)
        );
        let digest = String::from_utf8_lossy(&digest.stdout).trim().to_owned();
        let auth_file = dir.join("htpasswd");
        std::fs::write(&auth_file, format!("{username}:{digest}\n")).expect("write");
        let password_file = dir.join("bmc-password");
        std::fs::write(&password_file, format!("{password}\n")).expect("write");
        let port = free_port();
        let fake_systems: Vec<String> = systems
            .iter()
            .map(|s| {
                format!(
                    "{{'uuid': '{}', 'name': '{}', 'power_state': '{}', 'nics': []}}",
                    s.uuid,
                    s.name,
                    if s.on { "On" } else { "Off" }
                )
            })
            .collect();
        let config = format!(
            "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'\n\
             SUSHY_EMULATOR_LISTEN_PORT = {port}\n\
             SUSHY_EMULATOR_SSL_CERT = '{cert}'\n\
             SUSHY_EMULATOR_SSL_KEY = '{key}'\n\
             SUSHY_EMULATOR_AUTH_FILE = '{auth}'\n\
             SUSHY_EMULATOR_STATE_DIR = '{state}'\n\
             SUSHY_EMULATOR_FAKE_DRIVER = True\n\
             SUSHY_EMULATOR_FAKE_SYSTEMS = [{systems}]\n",
            cert = pki.server_cert.display(),
            key = pki.server_key.display(),
            auth = auth_file.display(),
            state = dir.join("state").display(),
            systems = fake_systems.join(", "),
        );
        let config_file = dir.join("emulator.conf");
        std::fs::write(&config_file, config).expect("write");
        let log = std::fs::File::create(dir.join("emulator.log")).expect("the emulator's log");
        let process = Command::new(&emulator)
            .arg("--config")
            .arg(&config_file)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log"))
            .stderr(log)
            .spawn()
            .expect("sushy-emulator starts");
        let emulator = Self {
            dir,
            process: Some(process),
            pki,
            port,
            username: username.to_owned(),
            password_file,
            systems,
        };
        emulator.wait_listening(Duration::from_secs(30));
        Some(emulator)
    }

    /// The CA that signed the emulator's certificate (`REQUESTS_CA_BUNDLE` for the
    /// agent, so it checks the BMC's certificate as it would a real one's).
    pub fn ca(&self) -> &Path {
        &self.pki.ca
    }

    /// The system named `name`.
    ///
    /// # Panics
    ///
    /// Where the emulator serves none by that name.
    pub fn system(&self, name: &str) -> &FakeSystem {
        self.systems
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no system {name}"))
    }

    /// The emulator's log so far (for a failed test's message).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("emulator.log")).unwrap_or_default()
    }

    fn wait_listening(&self, patience: Duration) {
        let start = Instant::now();
        while start.elapsed() < patience {
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "sushy-emulator is not listening after {patience:?}; its log:\n{}",
            self.log()
        );
    }
}

impl Drop for RedfishEmulator {
    fn drop(&mut self) {
        if let Some(mut child) = self.process.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `sushy-emulator` on `PATH`, or where `pip install --user` puts it.
fn find_sushy_emulator() -> Option<PathBuf> {
    let home_bin = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/bin"));
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain(home_bin)
        .map(|folder| folder.join("sushy-emulator"))
        .find(|path| {
            path.is_file()
                && Command::new(path)
                    .arg("--help")
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
        })
}

/// The interpreter a script's `#!` line names (pip's entry points name the python they
/// were installed for), else `python3`.
fn interpreter_of(script: &Path) -> PathBuf {
    let mut head = [0_u8; 256];
    let read = std::fs::File::open(script)
        .and_then(|mut f| f.read(&mut head))
        .unwrap_or(0);
    let text = String::from_utf8_lossy(&head[..read]);
    let words: Vec<&str> = text
        .lines()
        .next()
        .and_then(|line| line.strip_prefix("#!"))
        .map(|line| line.split_whitespace().collect())
        .unwrap_or_default();
    // `#!/usr/bin/env python3` names the interpreter second.
    let interpreter = match words.as_slice() {
        [env, name, ..] if env.ends_with("/env") => Some(*name),
        [path, ..] => Some(*path),
        [] => None,
    };
    PathBuf::from(interpreter.unwrap_or("python3"))
}
