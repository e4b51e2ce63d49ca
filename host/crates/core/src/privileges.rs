//! Whether this process may change GPU settings, decided from `/proc/self/status` without
//! touching a GPU.
//!
//! NVML's setters (power limit, locked clocks) need administrator rights: the NVIDIA kernel
//! driver checks for `CAP_SYS_ADMIN`, which root normally holds. Root inside a container
//! started without `--cap-add SYS_ADMIN` does not, so the capability, not the user id, decides.

use std::fmt;

/// Linux capability number of `CAP_SYS_ADMIN` (linux/capability.h).
const CAP_SYS_ADMIN: u32 = 21;

/// The privileges this process holds, as `/proc/self/status` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Privileges {
    /// Effective user id (`None` when it could not be read).
    pub effective_uid: Option<u32>,
    /// Whether `CAP_SYS_ADMIN` is in the effective set (`None` when it could not be read).
    pub cap_sys_admin: Option<bool>,
}

impl Privileges {
    /// The privileges of this process. Never fails: what cannot be read is `None`.
    pub fn current() -> Self {
        match std::fs::read_to_string("/proc/self/status") {
            Ok(status) => Self::from_status(&status),
            Err(_) => Self {
                effective_uid: None,
                cap_sys_admin: None,
            },
        }
    }

    /// Parse the text of `/proc/<pid>/status` (`Uid:` and `CapEff:` lines).
    pub fn from_status(status: &str) -> Self {
        let field = |name: &str| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .map(str::trim)
        };
        // "Uid:\treal\teffective\tsaved\tfilesystem"
        let effective_uid = field("Uid:")
            .and_then(|ids| ids.split_whitespace().nth(1))
            .and_then(|id| id.parse().ok());
        let cap_sys_admin = field("CapEff:")
            .and_then(|mask| u64::from_str_radix(mask, 16).ok())
            .map(|mask| mask & (1 << CAP_SYS_ADMIN) != 0);
        Self {
            effective_uid,
            cap_sys_admin,
        }
    }

    /// Whether the effective user is root.
    pub fn is_root(&self) -> bool {
        self.effective_uid == Some(0)
    }

    /// Whether NVML will let this process change power limits and clock locks.
    pub fn can_change_gpu_settings(&self) -> bool {
        match self.cap_sys_admin {
            Some(has) => has,
            // Without a readable capability set, root is the best guess.
            None => self.is_root(),
        }
    }

    /// Why settings cannot be changed, with the fix; `None` when they can.
    pub fn denial(&self) -> Option<Denial> {
        (!self.can_change_gpu_settings()).then_some(Denial(*self))
    }
}

/// The reason a process may not change GPU settings (see [`Privileges::denial`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Denial(Privileges);

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.0.effective_uid, self.0.cap_sys_admin) {
            (Some(0), Some(false)) => f.write_str(
                "running as root but without CAP_SYS_ADMIN (a container? start it with --cap-add SYS_ADMIN)",
            ),
            (Some(uid), _) => write!(
                f,
                "running as uid {uid} without CAP_SYS_ADMIN (run as root, or grant CAP_SYS_ADMIN)"
            ),
            (None, _) => f.write_str(
                "could not read /proc/self/status to check for root or CAP_SYS_ADMIN",
            ),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    fn status(uid: &str, cap_eff: &str) -> String {
        format!(
            "Name:\ttokwatt\nUmask:\t0022\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t0\t0\t0\t0\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff}\nCapBnd:\t000001ffffffffff\n"
        )
    }

    #[test]
    fn root_with_full_capabilities_may_change_settings() {
        let p = Privileges::from_status(&status("0", "000001ffffffffff"));
        assert_eq!(p.effective_uid, Some(0));
        assert_eq!(p.cap_sys_admin, Some(true));
        assert!(p.can_change_gpu_settings());
        assert!(p.denial().is_none());
    }

    #[test]
    fn root_without_cap_sys_admin_may_not() {
        // Docker's default set: CAP_SYS_ADMIN (bit 21) is missing.
        let p = Privileges::from_status(&status("0", "00000000a80425fb"));
        assert_eq!(p.cap_sys_admin, Some(false));
        assert!(!p.can_change_gpu_settings());
        let why = p.denial().map(|d| d.to_string()).unwrap_or_default();
        assert!(why.contains("--cap-add SYS_ADMIN"), "{why}");
    }

    #[test]
    fn ordinary_user_may_not_but_one_granted_cap_sys_admin_may() {
        let user = Privileges::from_status(&status("1000", "0000000000000000"));
        assert!(!user.can_change_gpu_settings());
        let why = user.denial().map(|d| d.to_string()).unwrap_or_default();
        assert!(why.contains("uid 1000"), "{why}");

        let granted = Privileges::from_status(&status("1000", "0000000000200000"));
        assert_eq!(granted.cap_sys_admin, Some(true));
        assert!(granted.can_change_gpu_settings());
    }

    #[test]
    fn unreadable_status_denies_with_a_reason() {
        let p = Privileges::from_status("garbage");
        assert_eq!(p.effective_uid, None);
        assert_eq!(p.cap_sys_admin, None);
        assert!(!p.can_change_gpu_settings());
        let why = p.denial().map(|d| d.to_string()).unwrap_or_default();
        assert!(why.contains("/proc/self/status"), "{why}");
    }

    #[test]
    fn current_process_status_parses() {
        // Every Linux process has both lines; whatever the privileges, they must be read.
        let p = Privileges::current();
        assert!(p.effective_uid.is_some());
        assert!(p.cap_sys_admin.is_some());
    }
}
