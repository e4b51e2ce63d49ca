//! Where the agent's control socket lives by default: one function, so `tokwatt serve`
//! and the clients (`tokwatt status`, `tokwatt policy`) always agree.

use std::path::{Path, PathBuf};

use tokwatt_core::privileges::Privileges;

/// The socket's file name inside its folder.
const SOCKET_FILE: &str = "tokwatt.sock";

/// Why there is no default socket path.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error(
    "there is no default control socket: $XDG_RUNTIME_DIR is not set (or not absolute) for this non-root user; pass --socket PATH"
)]
pub struct NoDefaultSocket;

/// `/run/tokwatt/tokwatt.sock` as root, else `$XDG_RUNTIME_DIR/tokwatt/tokwatt.sock`.
///
/// A non-root user without `$XDG_RUNTIME_DIR` gets an error rather than a guess: a folder
/// in the shared `/tmp` could be created first by another user.
pub fn default_socket_path() -> Result<PathBuf, NoDefaultSocket> {
    let runtime_dir = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from);
    default_socket_path_for(Privileges::current().is_root(), runtime_dir.as_deref())
}

fn default_socket_path_for(
    is_root: bool,
    runtime_dir: Option<&Path>,
) -> Result<PathBuf, NoDefaultSocket> {
    if is_root {
        return Ok(Path::new("/run/tokwatt").join(SOCKET_FILE));
    }
    match runtime_dir {
        // XDG: a relative path in the variable is invalid and must be ignored.
        Some(dir) if dir.is_absolute() => Ok(dir.join("tokwatt").join(SOCKET_FILE)),
        _ => Err(NoDefaultSocket),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_socket_follows_root_and_xdg_runtime_dir() {
        assert_eq!(
            default_socket_path_for(true, Some(Path::new("/run/user/1000"))),
            Ok(PathBuf::from("/run/tokwatt/tokwatt.sock"))
        );
        assert_eq!(
            default_socket_path_for(false, Some(Path::new("/run/user/1000"))),
            Ok(PathBuf::from("/run/user/1000/tokwatt/tokwatt.sock"))
        );
        assert_eq!(default_socket_path_for(false, None), Err(NoDefaultSocket));
        assert_eq!(
            default_socket_path_for(false, Some(Path::new("relative/dir"))),
            Err(NoDefaultSocket)
        );
        assert!(NoDefaultSocket.to_string().contains("--socket"));
    }
}
