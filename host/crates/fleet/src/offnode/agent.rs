//! Running a fence agent: its options on its standard input, a timeout, its exit code and
//! words read back, the password masked in whatever it says.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::config::NodeFenceAction;
use crate::store::StoreError;

/// At most this much of an agent's output is kept in a proof's `detail` and in an error.
const OUTPUT_LIMIT: usize = 1000;

/// Why an off-node fence action proved nothing. Never holds the BMC's password.
#[derive(Debug, thiserror::Error)]
pub enum OffNodeError {
    #[error("cannot start the fence agent {agent}: {source}")]
    Spawn {
        agent: String,
        source: std::io::Error,
    },
    #[error("cannot talk to the fence agent {agent}: {source}")]
    Io {
        agent: String,
        source: std::io::Error,
    },
    #[error("cannot read node `{node}`'s BMC password from {from}: {why}")]
    Password {
        node: String,
        from: String,
        why: String,
    },
    #[error("`{agent}` action={action} ran past its {timeout:?} timeout and was killed")]
    TimedOut {
        agent: String,
        action: &'static str,
        timeout: Duration,
    },
    #[error("`{agent}` action={action} was cancelled (killed)")]
    Cancelled { agent: String, action: &'static str },
    #[error("`{agent}` action={action} failed ({exit}): {output}")]
    Failed {
        agent: String,
        action: &'static str,
        exit: String,
        output: String,
    },
    #[error(
        "`{agent}` action=status after the power-off does not read OFF ({exit}): {output}; nothing is proven"
    )]
    NotOff {
        agent: String,
        exit: String,
        output: String,
    },
    #[error("the node is powered off, but its proof could not be written: {0}")]
    Store(#[from] StoreError),
}

/// What the agent is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentAction {
    Off,
    Status,
}

impl AgentAction {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Status => "status",
        }
    }
}

/// How an agent invocation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentRun {
    /// Its exit code (`None`: killed by a signal).
    pub exit_code: Option<i32>,
    /// Its standard output then standard error, trimmed, the password masked, at most
    /// [`OUTPUT_LIMIT`] characters.
    pub output: String,
}

impl AgentRun {
    fn exit_words(&self) -> String {
        match self.exit_code {
            Some(code) => format!("exit {code}: {}", exit_meaning(code)),
            None => "killed by a signal".into(),
        }
    }

    /// Whether a `status` run reads the node powered off: the fence agent API's exit 2
    /// and its `Status: OFF` line.
    pub fn reads_off(&self) -> bool {
        self.exit_code == Some(2)
            && self
                .output
                .lines()
                .any(|l| l.trim().eq_ignore_ascii_case("status: off"))
    }
}

/// The fence agents' exit codes (fencing.py's `EC_*`), in words.
fn exit_meaning(code: i32) -> &'static str {
    match code {
        0 => "success",
        1 => "generic error",
        2 => "bad arguments (or, for status, powered off)",
        3 => "unable to connect or log in to the fencing device",
        4 => "connection lost",
        5 => "timed out",
        6 => "timed out waiting for the power to come on",
        7 => "timed out waiting for the power to go off",
        8 => "unable to read the plug's status",
        10 => "no password",
        11 => "invalid privileges",
        _ => "unknown",
    }
}

/// Runs `action` once through the node's agent, its options on its standard input, and
/// waits for it at most `fence.timeout` (killed past it, or once `cancel` is set).
pub fn run_agent(
    fence: &NodeFenceAction,
    action: AgentAction,
    cancel: &AtomicBool,
) -> Result<AgentRun, OffNodeError> {
    let agent = fence.agent_name();
    let password = match &fence.password {
        Some(source) => Some(source.read().map_err(|why| OffNodeError::Password {
            node: fence.node.clone(),
            from: source.describe(),
            why,
        })?),
        None => None,
    };
    let mut input = format!("action={}\n", action.as_str());
    for (name, value) in &fence.options {
        input.push_str(&format!("{name}={value}\n"));
    }
    if let Some(password) = &password {
        input.push_str(&format!("password={password}\n"));
    }
    let mut child = Command::new(&fence.agent)
        .envs(&fence.env)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| OffNodeError::Spawn {
            agent: agent.clone(),
            source,
        })?;
    let io = |source| OffNodeError::Io {
        agent: fence.agent_name(),
        source,
    };
    // Readers on threads of their own: an agent that writes more than a pipe holds must
    // not block on us while we wait for it to exit.
    let stdout = child.stdout.take().map(read_on_a_thread);
    let stderr = child.stderr.take().map(read_on_a_thread);
    if let Some(mut stdin) = child.stdin.take() {
        // The options are a few hundred bytes, within a pipe's buffer; an agent that
        // exits without reading them says why in its output and exit code.
        match stdin.write_all(input.as_bytes()) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io(e));
            }
        }
        // Dropped here: the agent reads its options to the end of its input.
    }
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(io)? {
            break status;
        }
        let cancelled = cancel.load(Ordering::Relaxed);
        if cancelled || started.elapsed() >= fence.timeout {
            let _ = child.kill();
            let _ = child.wait();
            return Err(if cancelled {
                OffNodeError::Cancelled {
                    agent,
                    action: action.as_str(),
                }
            } else {
                OffNodeError::TimedOut {
                    agent,
                    action: action.as_str(),
                    timeout: fence.timeout,
                }
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut output = String::new();
    for text in [stdout, stderr].into_iter().flatten().map(collect_output) {
        let text = text.trim();
        if !text.is_empty() {
            if !output.is_empty() {
                output.push('\n');
            }
            output.push_str(text);
        }
    }
    if let Some(password) = &password {
        output = output.replace(password.as_str(), "********");
    }
    Ok(AgentRun {
        exit_code: status.code(),
        output: clip(&output),
    })
}

fn read_on_a_thread(mut pipe: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        let _ = tx.send(String::from_utf8_lossy(&bytes).into_owned());
    });
    rx
}

/// A pipe's text, once the agent has exited: a child of the agent that still holds the
/// pipe open is not waited for beyond a second.
fn collect_output(rx: mpsc::Receiver<String>) -> String {
    rx.recv_timeout(Duration::from_secs(1)).unwrap_or_default()
}

fn clip(text: &str) -> String {
    if text.chars().count() <= OUTPUT_LIMIT {
        return text.to_owned();
    }
    let kept: String = text.chars().take(OUTPUT_LIMIT).collect();
    format!("{kept} …")
}

/// A node powered off and read back off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoweredOff {
    /// The agent and its BMC (the proof's `by`).
    pub by: String,
    /// The agent's words, off then status (the proof's `detail`).
    pub detail: String,
    /// When the status read OFF, by this host's clock.
    pub at_unix_ms: u64,
}

/// Powers the node off through its agent, then reads its power state back through it:
/// `Ok` only where the status reads OFF.
pub fn power_off(fence: &NodeFenceAction, cancel: &AtomicBool) -> Result<PoweredOff, OffNodeError> {
    let off = run_agent(fence, AgentAction::Off, cancel)?;
    if off.exit_code != Some(0) {
        return Err(OffNodeError::Failed {
            agent: fence.agent_name(),
            action: AgentAction::Off.as_str(),
            exit: off.exit_words(),
            output: off.output,
        });
    }
    let status = run_agent(fence, AgentAction::Status, cancel)?;
    if !status.reads_off() {
        return Err(OffNodeError::NotOff {
            agent: fence.agent_name(),
            exit: status.exit_words(),
            output: status.output,
        });
    }
    let at_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    Ok(PoweredOff {
        by: fence.proof_by(),
        detail: clip(&format!("off: {}; status: {}", off.output, status.output)),
        at_unix_ms,
    })
}
