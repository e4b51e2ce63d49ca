//! Whether the tokwatt that wrote a state file still runs: its settings are then its own
//! to restore, and nobody else may restore or overwrite them under it.

use std::fs;
use std::path::Path;

/// Whether `pid` is another live tokwatt (so its state file must not be restored under it).
pub(super) fn owned_by_other_live_process(pid: u32) -> bool {
    owner_alive_in(Path::new("/proc"), pid, std::process::id())
}

/// [`owned_by_other_live_process`] against the process table under `proc_root`: `pid`
/// counts when it is not ours, has not exited (zombies have) and runs the same command.
fn owner_alive_in(proc_root: &Path, pid: u32, own_pid: u32) -> bool {
    if pid == own_pid {
        return false;
    }
    let process = proc_root.join(pid.to_string());
    let Ok(theirs) = fs::read_to_string(process.join("comm")) else {
        return false;
    };
    // "pid (comm) state ...": the state follows the last parenthesis.
    let zombie = fs::read_to_string(process.join("stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false);
    let ours = fs::read_to_string(proc_root.join(own_pid.to_string()).join("comm"));
    !zombie && ours.is_ok_and(|ours| ours == theirs)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    fn fake_process(root: &Path, pid: u32, comm: &str, state: char) {
        let dir = root.join(pid.to_string());
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("comm"), format!("{comm}\n")).unwrap();
        fs::write(
            dir.join("stat"),
            format!("{pid} ({comm}) {state} 1 1 1 0 -1"),
        )
        .unwrap();
    }

    #[test]
    fn only_another_live_tokwatt_owns_a_state_file() {
        let proc_root = tempfile::tempdir().unwrap();
        let root = proc_root.path();
        fake_process(root, 10, "tokwatt", 'R');
        fake_process(root, 42, "tokwatt", 'S');
        fake_process(root, 43, "tokwatt", 'Z');
        fake_process(root, 44, "bash", 'S');
        assert!(owner_alive_in(root, 42, 10));
        assert!(!owner_alive_in(root, 10, 10), "our own file is a leftover");
        assert!(!owner_alive_in(root, 43, 10), "a zombie has exited");
        assert!(
            !owner_alive_in(root, 44, 10),
            "pid reused by another program"
        );
        assert!(!owner_alive_in(root, 45, 10), "gone");
        // The real process table: this test process is not another owner.
        assert!(!owned_by_other_live_process(std::process::id()));
    }
}
