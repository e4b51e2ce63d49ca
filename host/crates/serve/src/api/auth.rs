//! The HTTP listener's access control: a bearer token read from a file only its owner can
//! read, compared in constant time. (The Unix socket has no token: its file mode is the
//! access control.)

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use sha2::{Digest, Sha256};

use super::server::ApiError;

/// The agent's bearer token. Only a digest is kept, so comparing takes the same time
/// whatever the length or content of what a request offers.
#[derive(Clone)]
pub(crate) struct BearerToken {
    digest: [u8; 32],
}

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken(..)")
    }
}

impl BearerToken {
    /// The token in `path`: the file must exist, be readable by its owner alone, and hold a
    /// non-empty token (surrounding whitespace, such as a final newline, is ignored).
    pub(crate) fn from_file(path: &Path) -> Result<Self, ApiError> {
        let token_error = |why: String| ApiError::TokenFile {
            path: path.to_owned(),
            why,
        };
        let metadata = std::fs::metadata(path).map_err(|error| {
            token_error(format!(
                "cannot be read ({error}); create it with `head -c 32 /dev/urandom | base64 > {0} && chmod 600 {0}`",
                path.display()
            ))
        })?;
        if !metadata.is_file() {
            return Err(token_error("is not a file".into()));
        }
        let mode = metadata.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(token_error(format!(
                "is open to group or others (mode {mode:03o}): chmod 600 {}",
                path.display()
            )));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|error| token_error(format!("cannot be read as text ({error})")))?;
        let token = text.trim();
        if token.is_empty() {
            return Err(token_error(format!(
                "is empty; write a token into it: `head -c 32 /dev/urandom | base64 > {0} && chmod 600 {0}`",
                path.display()
            )));
        }
        Ok(Self::new(token))
    }

    pub(crate) fn new(token: &str) -> Self {
        Self {
            digest: Sha256::digest(token.as_bytes()).into(),
        }
    }

    /// Whether an `Authorization` header's value carries this token.
    pub(crate) fn accepts(&self, authorization: Option<&[u8]>) -> bool {
        let Some(offered) = authorization.and_then(bearer_credentials) else {
            return false;
        };
        let offered: [u8; 32] = Sha256::digest(offered).into();
        // Every byte is compared whatever the first difference (no early exit).
        let difference = offered
            .iter()
            .zip(self.digest.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        difference == 0
    }
}

/// The credentials of `Bearer <credentials>` (the scheme's case ignored, as RFC 7235 says).
fn bearer_credentials(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer ";
    if value.len() <= SCHEME.len() || !value[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    let credentials = value[SCHEME.len()..].trim_ascii();
    (!credentials.is_empty()).then_some(credentials)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn only_the_exact_token_is_accepted() {
        let token = BearerToken::new("s3cret");
        assert!(token.accepts(Some(b"Bearer s3cret")));
        assert!(token.accepts(Some(b"bearer s3cret")));
        assert!(!token.accepts(None));
        assert!(!token.accepts(Some(b"Bearer s3cre")));
        assert!(!token.accepts(Some(b"Bearer s3cret2")));
        assert!(!token.accepts(Some(b"Basic s3cret")));
        assert!(!token.accepts(Some(b"s3cret")));
        assert!(!token.accepts(Some(b"Bearer ")));
    }

    #[test]
    fn a_token_file_open_to_others_or_empty_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("token");
        std::fs::write(&path, "abc\n").expect("write");

        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let error = BearerToken::from_file(&path).expect_err("world-readable");
        assert!(error.to_string().contains("chmod 600"), "{error}");

        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let token = BearerToken::from_file(&path).expect("owner-only file");
        assert!(token.accepts(Some(b"Bearer abc")), "the newline is trimmed");

        std::fs::write(&path, " \n").expect("write");
        let error = BearerToken::from_file(&path).expect_err("empty");
        assert!(error.to_string().contains("is empty"), "{error}");

        let error = BearerToken::from_file(&dir.path().join("missing")).expect_err("missing");
        assert!(error.to_string().contains("create it"), "{error}");
    }
}
